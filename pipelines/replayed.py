"""The frames a live HLS playlist gives again when it is reopened (`Replayed`).

Reopened, a live playlist is joined three segments before its end (FFmpeg's `live_start_index`):
after a short outage, seconds already captioned; after its encoder died (the playlist left as it
was, with no end), its last seconds, at every reopen, each time taken for the stream coming back
("back after 6.0 s"): a dead camera's last 3 s were captioned for ever, and `--max-outage` never
came. MPEG-TS times run on across segments, so a frame given again has the very time of one given
before; an encoder that restarts starts its times afresh, and its frames are new.
"""

from __future__ import annotations

from collections import deque

KEEP = 4096  # frame times remembered: over a minute at 60 fps, more than the 3 segments replayed
# A reopen is joined at most a few segments before the end of what came: a first frame further
# back is no replay but an encoder that restarted, whose MPEG-TS times begin where its last run's
# did (1.4 s): taken for a replay, its frames were left out up to the old run's last time.
REPLAY_WINDOW_S = 30.0


class Replayed:
    def __init__(self, keep: int = KEEP):
        self._times: deque[float] = deque(maxlen=keep)
        self._skipping: bool | None = False

    def reopened(self) -> None:
        """The playlist was opened again: its first frame says whether it replays what came."""
        self._skipping = None

    def again(self, time: float | None) -> bool:
        """Whether the frame at this stream time came before (to be left out)."""
        if time is None:
            return False
        if self._skipping is None:  # the first frame after a reopen: one seen lately begins a replay
            self._skipping = time in self._times and self._times[-1] - time <= REPLAY_WINDOW_S
        if self._skipping and time <= self._times[-1]:
            return True
        self._skipping = False
        self._times.append(time)
        return False
