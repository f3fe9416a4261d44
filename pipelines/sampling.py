"""Which frames of a video are processed: every frame, N per second of video time, or every Nth.

`Sampling` is checked when it is made (a ValueError for a rate that is not a finite number in
(0, MAX_FPS], an every_n that is not a whole number >= 1, or both given). Its `picker()` decides
each frame by its index and time alone, in decode order, so a source asks it before converting
the frame to RGB; `period()` is how long each processed frame's answer stands for (subtitles, an
annotated video). Used by `caption_file` (pipelines/batch.py) and by --resume (resume.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from .frame import Frame

MAX_FPS = 1e6  # frames a second of video time to process; any rate past the video's takes every frame


@dataclass(frozen=True)
class Sampling:
    """Which frames to process: every frame, `fps` per second of video time, or every Nth."""

    fps: float | None = None
    every_n: int | None = None

    def __post_init__(self):
        # NaN and infinity too: an infinite rate made the picker's next time never pass a frame (a hang)
        if self.fps is not None and not 0 < self.fps <= MAX_FPS:
            raise ValueError(f"fps must be a finite number > 0 and at most {MAX_FPS:g}, got {self.fps}")
        if self.every_n is not None and (isinstance(self.every_n, bool) or not isinstance(self.every_n, int)
                                         or self.every_n < 1):
            raise ValueError(f"every_n must be an integer >= 1, got {self.every_n!r}")
        if self.fps is not None and self.every_n is not None:  # every_n picked, fps timed the subtitles
            raise ValueError("give fps or every_n, not both")

    def period(self, video_fps: float | None) -> float:
        """Seconds between the frames processed: how long each one's answer stands for."""
        rate = video_fps or 30.0
        if self.fps:
            return max(1.0 / self.fps, 1.0 / rate)
        return (self.every_n or 1) / rate

    def select(self, frames: Iterable[Frame]) -> Iterator[Frame]:
        pick = self.picker()
        return (f for f in frames if pick(f.index, f.pts))

    def picker(self) -> Callable[[int, float], bool]:
        """A fresh predicate over (index, pts) in decode order: whether that frame is processed.
        A source asks it before converting a frame to RGB, the larger part of reading one."""
        if self.every_n:
            return lambda index, pts: index % self.every_n == 0
        if not self.fps:
            return lambda index, pts: True
        fps, t0, n = self.fps, None, 0

        # Slot n is at t0 + n / fps; a frame is taken at or after its slot (within a microsecond:
        # FFmpeg rounds a file's start time to one, so an MPEG-TS frame due at 0.5 s came at
        # 0.4999997 and the next one was taken instead), and the next slot is the first after it.
        # Computed, not stepped a period at a time: --fps 1e9 took 25 s on a 1 s clip.
        def pick(index: int, pts: float) -> bool:
            nonlocal t0, n
            if t0 is None:
                t0 = pts
            elif pts < t0 + n / fps - 1e-6:
                return False
            n = max(n + 1, math.floor((pts - t0 + 1e-6) * fps) + 1)
            return True

        pick.next_slot = lambda: t0 + n / fps  # a frame from this time on is taken next (resume.py)
        return pick
