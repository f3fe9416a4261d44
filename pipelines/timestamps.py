"""A file's frame times as FFmpeg's own tools give them.

`BestEffort` is libavcodec's best-effort timestamp (guess_correct_pts): a frame's own pts, unless
those go backwards more often than the decode timestamps do. AVI and ASF store no presentation
times: PyAV handed H.264 frames with B-frames the pts of the packet they came in, in decode order
(0.033, 0.133, 0.1, 0.167, 0.067 s), and their subtitles overlapped and went backwards.

`Continuous` removes the jumps of formats whose clock may jump (MPEG-TS, HLS, MPEG-PS: recordings
joined end to end, a camera's clock reset) from the packets, in the order they are read, before
they are decoded, as ffmpeg does: a packet more than `threshold_s` away from where the one before
it ended, or over 0.1 s before the furthest time seen, moves the clock by the difference. Done on
the frames instead (in display order), a damaged stretch whose few frames came out of order moved
every later frame, by a second at each (a 6 s file ended at 7.9 s).
"""

from __future__ import annotations

from fractions import Fraction

BACKWARDS_S = 0.1  # ffmpeg's own margin for a packet behind the furthest time seen
# Where two recordings were joined, the demuxer marks corrupt the packet it was still assembling
# from the first when the second's continuity counters restart, and hands it out a packet or two
# ahead of the second's first, whose jump the clock sees: a mark this many packets before a jump
# is the join's, no data lost.
JOIN_PACKETS = 16


class BestEffort:
    def __init__(self) -> None:
        self.faulty_pts = self.faulty_dts = 0
        self.last_pts: float | None = None
        self.last_dts: float | None = None
        self._step: float | None = None  # between the last two decode timestamps

    def __call__(self, pts: float | None, dts: float | None) -> float | None:
        """The frame's time: its pts or its packet's dts (in seconds: a deinterlaced frame's pts
        is in its filter's time base, its dts in the stream's), or None if neither."""
        by_dts = self.faulty_pts > self.faulty_dts
        if dts is None and by_dts and self.last_dts is not None and self._step:
            # The frames the decoder gives at the end (no packet: no dts) follow the others
            # (their own pts were the scrambled ones: the last frame came before the one before it).
            dts = self.last_dts + self._step
        if dts is not None:
            self.faulty_dts += self.last_dts is not None and dts <= self.last_dts
            if self.last_dts is not None and dts > self.last_dts:
                self._step = dts - self.last_dts
            self.last_dts = dts
        if pts is not None:
            self.faulty_pts += self.last_pts is not None and pts <= self.last_pts
            self.last_pts = pts
        if pts is not None and (self.faulty_pts <= self.faulty_dts or dts is None):
            return pts
        return dts


class Continuous:
    def __init__(self, time_base: Fraction, frame_s: float, threshold_s: float):
        """time_base: the stream's; frame_s: a frame's duration where a packet does not say its own."""
        self._tb = float(time_base)
        self._frame_ticks = max(1, round(frame_s / self._tb)) if self._tb else 1
        self._threshold = round(threshold_s / self._tb) if self._tb else 0
        self._behind = round(BACKWARDS_S / self._tb) if self._tb else 0
        self.offset = 0  # ticks added to every packet's times from here on
        self.jumps = 0
        self.jumped = False  # at the last packet (where MPEG-TS's continuity counters restart too)
        self._next: int | None = None  # where the last packet ended, on the continuous clock
        self._furthest: int | None = None
        self._packets = 0
        self._marks: list[int] = []  # corrupt marks no jump has followed yet (their packet numbers)
        self._lost = 0  # corrupt marks no jump followed: data lost

    def mark_corrupt(self) -> None:
        """The demuxer marked the packet just moved corrupt (MPEG-TS continuity broken)."""
        if not self.jumped:
            self._marks.append(self._packets)

    def lost(self) -> int:
        """The corrupt marks so far that were no join's (the last ones: unless a jump follows)."""
        return self._lost + len(self._marks)

    def __call__(self, packet) -> None:
        """Move the packet's pts and dts onto the continuous clock (in place)."""
        self._packets += 1
        while self._marks and self._packets - self._marks[0] > JOIN_PACKETS:
            self._marks.pop(0)
            self._lost += 1
        self.jumped = False
        if not self._tb:
            return
        dts = packet.dts if packet.dts is not None else packet.pts
        if dts is None:
            return
        dts += self.offset
        if self._next is not None:
            delta = dts - self._next
            if abs(delta) > self._threshold or dts + self._behind < self._furthest:
                self.offset -= delta
                dts -= delta
                self.jumps += 1
                self.jumped = True
                self._marks.clear()
        if packet.dts is not None:
            packet.dts = dts
        if packet.pts is not None:
            packet.pts += self.offset
        self._next = dts + (packet.duration or self._frame_ticks)
        self._furthest = dts if self._furthest is None else max(self._furthest, dts)
