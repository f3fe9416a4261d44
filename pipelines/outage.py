"""One outage of a live source (`Outage`): frames stopped coming, and maybe came again.

A `Connection` makes one when frames stop (`lost`) and hands it, as it changes, to its
`on_outage`: open (`end` None) when the loss is found, then closed when a frame comes again
(`end`), or given up (`gave_up`, `--max-outage`). Its times are `time.perf_counter()` readings,
the clock frames are captured on (`Frame.captured_at`), so a recording can place it among them;
`utc` turns one into the wall clock's time for people. An outage runs from the last frame before
it to the first frame after it: `duration` is the time without frames, as "back after 41.2 s" says.

What the live outputs make of it: `record` is the JSON line of a live log (`live -o`), `card` the
text drawn over the recording's frozen picture while it lasts and `back` the note on the first
frames after it (`live --annotate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone


def _wall_offset() -> float:
    return time.time() - time.perf_counter()


@dataclass(frozen=True)
class Outage:
    source: str  # the source as its frames name it (the log's "source"), credentials redacted
    start: float  # perf_counter: the last frame before it came
    reason: str  # why frames stopped: "nothing came for 3.0 s", "the stream ended"...
    end: float | None = None  # perf_counter: the first frame after it came; None while it lasts
    gave_up: float | None = None  # perf_counter: when the source was given up in it (--max-outage)
    # time.time() - perf_counter() when it began: the wall clock moved by NTP later leaves it as it was
    wall_offset: float = field(default_factory=_wall_offset)

    @property
    def over(self) -> bool:
        """Frames came again, or the source was given up."""
        return self.end is not None or self.gave_up is not None

    def closed(self, end: float) -> Outage:
        return replace(self, end=end)

    def given_up(self, at: float) -> Outage:
        return replace(self, gave_up=at)

    def duration(self, now: float | None = None) -> float:
        """Seconds without frames: to its end, its giving up, or `now` (default: this moment)."""
        until = self.end if self.end is not None else self.gave_up
        return (until if until is not None else time.perf_counter() if now is None else now) - self.start

    def utc(self, t: float) -> datetime:
        return datetime.fromtimestamp(t + self.wall_offset, timezone.utc)

    def record(self, state: str, now: float | None = None) -> dict:
        """A live log's line: {"event": "outage", "state": ...}: "began" (found: `start` and the
        `reason`), "ended" (frames again: `end` and `duration_s`), "gave_up" (--max-outage), or
        "unfinished" (the run ended in it); `duration_s` the seconds without frames so far, `time`
        when the line was written (as a frame's line has it)."""
        line = {"event": "outage", "state": state, "source": self.source, "start": self._stamp(self.start),
                "end": None if self.end is None else self._stamp(self.end), "reason": self.reason}
        if state != "began":
            line["duration_s"] = round(self.duration(now), 3)
        line["time"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        return line

    def card(self, now: float | None = None) -> str:
        """What the recording shows over its last picture for as long as the outage lasts."""
        lost = f"STREAM LOST at {self._clock(self.start)}"
        if self.end is not None:
            return f"{lost}: no frames for {span(self.duration())}, back at {self._clock(self.end)}"
        if self.gave_up is not None:
            return f"{lost}: given up after {span(self.duration())} without frames"
        return f"{lost}: no frames for the last {span(self.duration(now))} of the recording"

    def back(self) -> str:
        """The note on the recording's first frames after it."""
        assert self.end is not None
        return f"stream lost for {span(self.duration())} ({self._clock(self.start)} to {self._clock(self.end)})"

    def _stamp(self, t: float) -> str:
        return self.utc(t).isoformat(timespec="milliseconds")  # as a frame's line says its "time"

    def _clock(self, t: float) -> str:
        return self.utc(t).strftime("%H:%M:%S UTC")


def span(seconds: float) -> str:
    """A duration as the terminal's lines say it: "41.2 s", "3 min"."""
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
