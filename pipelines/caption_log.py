"""A live feed's caption log: a line (`LogLine`) per run of frames that got the same answers.

`extend_log` adds a result: the newest line grows while the answers stay the same (by
`answer_key`), else a line starts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .changes import answer_key


@dataclass(frozen=True)
class LogLine:
    """A run of frames that got the same answers (a line of the caption log): the log of a 60 fps
    stream says what changed and when, not the same caption sixty times a second."""

    wall: float  # time.time() when the run's last result arrived
    pts: float  # the run's last frame
    index: int
    text: str
    end_to_end_ms: float  # the last frame's
    first_wall: float = 0.0  # when the run began (its first result)
    first_pts: float = 0.0
    frames: int = 1


def extend_log(log: deque[LogLine], wall: float, pts: float, index: int, text: str, end_to_end_ms: float,
               in_order: bool = False) -> bool:
    """Add a result to the log: the newest run grows if the answers are the same (`answer_key`:
    the same things named, in any order, or in theirs where `in_order`; the line takes the newest
    wording, as the caption shown does), else a run starts (True)."""
    last = log[-1] if log else None
    if last is not None and (last.text == text or answer_key(last.text, in_order) == answer_key(text, in_order)):
        log[-1] = LogLine(wall, pts, index, text, end_to_end_ms, last.first_wall, last.first_pts, last.frames + 1)
        return False
    log.append(LogLine(wall, pts, index, text, end_to_end_ms, wall, pts))
    return True
