"""Keeping a live stream's decoding in real time.

A stream that sends more than this machine decodes beside the model (4K at 60 fps on two cores)
falls further behind with every frame: over TCP the backlog grows without bound, over UDP up to
the receive buffer (seconds of video), and every caption then describes a moment long gone while
the latency figures, counted from when a frame was decoded, look fine. `CatchUp` watches how late
each decoded frame comes against the stream's own clock and, once one is more than `CATCH_UP_S`
late, has the decoder skip all but keyframes (it then only parses) until the stream's edge is
reached. Frames are lost either way; this way the frames decoded are recent ones. Only streams
pushed with their sender's clock are watched (schemes.CLOCKED_SCHEMES: RTSP, RTMP, UDP...).

How late a frame is: wall time minus its stream time, against the least such offset seen (the
stream's edge). The least offset may creep up by `DRIFT` a second, so a camera's clock that runs
slower than this one never adds up to lateness; a backlog grows a hundred times faster.

A backlog also grows a little with each frame (the decoder is busy; it can add at most the time
it took). A frame later than the one before it by `STEP_S` at once is no backlog: the sender
restarted (its timestamps start over), its timestamps jumped, or it paused. That frame is the
new edge. Without this, a camera restarted within seconds looked several seconds behind, and
its frames were skipped to keyframes for `GIVE_UP_S`.

A backlog is packets waiting to be read: time the reader spent waiting for the next packet
(beyond `WAIT_S`, a busy machine's scheduling) is the sender's, and moves the edge by as much. A
stream whose timestamps run slower than it sends (a program's frames piped to an encoder at a
nominal 60 fps, sent at 5: timestamps by frame count) looked 0.18 s later with each frame, and
was decoded at its keyframes only, with "decoding is 1.2 s behind" said, while the reader sat
waiting for every packet.
"""

from __future__ import annotations

CATCH_UP_S = 1.0  # later than this: decode keyframes only
CAUGHT_UP_S = 0.25  # back within this: decode every frame again
STEP_S = 0.5  # one frame later than the one before it by this: a discontinuity or a pause, not a backlog
GIVE_UP_S = 5.0  # keyframes only for this long without catching up: take where it is as the edge
DRIFT = 0.001  # seconds a second the edge may creep (clocks differ by far less: ~0.0001)
WAIT_S = 0.01  # a read that waited longer than this found no packet waiting: the rest is no backlog


class CatchUp:
    def __init__(self, codec_context):
        self._codec = codec_context
        self._edge: float | None = None  # least (wall time - stream time) seen, creeping by DRIFT
        self._last_wall: float | None = None
        self._offset: float | None = None  # the last frame's (wall time - stream time)
        self._since: float | None = None  # when skipping began; None while decoding every frame
        self._waited = 0.0  # seconds the reader waited for packets since the last frame (past WAIT_S each)
        self.late = self.max_late = 0.0  # seconds: the last decoded frame's, and the most of any
        self.catch_ups = 0  # times it skipped ahead

    @property
    def skipping(self) -> bool:
        return self._since is not None

    def frame(self, stream_time: float | None, now: float) -> None:
        """A frame was decoded at wall time `now` (perf_counter seconds)."""
        if stream_time is None:
            return
        offset = now - stream_time
        if self._edge is not None and self._last_wall is not None:
            self._edge += DRIFT * (now - self._last_wall) + self._waited
        self._waited = 0.0
        self._last_wall = now
        jumped = self._offset is not None and offset - self._offset > STEP_S
        if self._edge is None or offset < self._edge or jumped:
            self._edge = offset
        self._offset = offset
        self.late = offset - self._edge
        self.max_late = max(self.max_late, self.late)
        if not self.skipping and self.late > CATCH_UP_S:
            self._codec.skip_frame = "NONKEY"
            self._since = now
            self.catch_ups += 1
        elif self.skipping and self.late < CAUGHT_UP_S:
            self._resume()

    def packet(self, now: float, waited: float = 0.0) -> None:
        """Before each packet, which the reader waited `waited` seconds for: a stream with no
        keyframe to come (or a lateness that skipping does not cure) must not leave the decoder
        skipping for good."""
        if waited > WAIT_S:
            self._waited += waited - WAIT_S
        if self.skipping and now - self._since > GIVE_UP_S:
            self._edge = None  # the next frame is the edge
            self._resume()

    def _resume(self) -> None:
        self._codec.skip_frame = "DEFAULT"
        self._since = None
