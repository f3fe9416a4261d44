"""A live session's figures over a recent window, bounded however long it runs.

`LatencyWindow`: one stage's last LATENCY_WINDOW latencies and their percentiles. `rolling_rate`:
completions a second over the newest ROLLING_S seconds (longer for answers further apart), a
silence since the last one counted.
"""

from __future__ import annotations

import numpy as np

LATENCY_WINDOW = 36_000  # ten minutes at 60 fps
ROLLING_S = 2.0  # the frames a second a page shows count over this much of the newest past
# A slow model's answers (Moondream 2 on a CPU: one every ~15 s) fall further apart than ROLLING_S:
# the page said "0.0" fps while they came. The window then spans this many of their intervals,
# up to ROLLING_MAX_S, so that it holds a few of them and still empties once they stop.
ROLLING_INTERVALS = 4
ROLLING_MAX_S = 120.0


def rolling_rate(times: list[float], end: float) -> float:
    """Completions a second over the ROLLING_S seconds up to `end`, or ROLLING_INTERVALS times the
    newest interval where that is longer (the times in seconds, oldest first; through an outage
    it had said the rate before it). A silence since the last completion
    longer than their usual interval counts, beyond that interval: frames that stopped 1.9 s ago
    still said the full rate of the 0.1 s before, until the window emptied and it fell to 0 at once."""
    window = ROLLING_S
    if len(times) >= 2:  # the newest interval, however old: a 60 fps stream keeps its 2 s
        window = min(max(window, ROLLING_INTERVALS * (times[-1] - times[-2])), ROLLING_MAX_S)
    c = [t for t in times if t >= end - window]
    if len(c) < 2 or c[-1] <= c[0]:
        return 0.0
    span = c[-1] - c[0]
    return (len(c) - 1) / (span + max(0.0, end - c[-1] - span / (len(c) - 1)))


class LatencyWindow:
    """One stage's last `size` latencies (ms), in an array made once. Deques of floats had taken
    ~300 bytes a result (9.5 MB a source once full: RSS grew for ten minutes of a live run) and
    their percentiles 13 ms a call, which a web page makes twice a second. Appended on one thread,
    read on others."""

    def __init__(self, size: int = LATENCY_WINDOW):
        self._values = np.empty(size)  # pages are taken as they are written
        self._n = 0  # values appended in all

    def append(self, value: float) -> None:
        self._values[self._n % len(self._values)] = value
        self._n += 1  # after the value: a reader never counts a slot not yet written

    def clear(self) -> None:
        self._n = 0

    def __len__(self) -> int:
        return min(self._n, len(self._values))

    def percentiles(self) -> dict[str, float]:
        """p50, p90 and p99 (ms), and the number of latencies they are taken over (`samples`): a
        p99 of 5 frames is their largest two interpolated, not a 1-in-100 tail, and a reader of the
        figures alone (`live --json` of a short run) could not tell."""
        n = len(self)
        p50, p90, p99 = np.percentile(self._values[:n], [50, 90, 99])
        return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3), "samples": n}
