"""What a viewer of a live feed gets from a poll: `FeedSnapshot`, and its latency chart's points.

A copy taken under the feed's lock (`LiveFeed.snapshot`): the newest answer with its frame, the
caption log, a `LatencyPoint` per result of the last window (CHART_STAGES, each >= 0), the
counters and the pictures of the last changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .caption_log import LogLine
from .shot import Shot

CHART_STAGES = ("queue", "vision", "prefill", "decode")


@dataclass(frozen=True)
class LatencyPoint:
    wall: float
    index: int
    stages_ms: dict[str, float]  # CHART_STAGES, each >= 0
    end_to_end_ms: float


@dataclass
class FeedSnapshot:
    version: int
    running: bool
    error: str | None
    frame_rgb: np.ndarray | None  # the frame the newest caption describes
    text: str
    pts: float
    index: int
    end_to_end_ms: float
    log: list[LogLine] = field(default_factory=list)  # newest last
    latency: list[LatencyPoint] = field(default_factory=list)  # oldest first, last window_s seconds
    counters: dict = field(default_factory=dict)
    shots: list[Shot] = field(default_factory=list)  # newest last, the last SHOTS changes
    running_s: float | None = None  # how long the feed has run (a page's wait for a first answer)
