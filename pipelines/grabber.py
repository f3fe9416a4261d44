"""Latest-frame grabbing: a thread reads a source and keeps only its newest frame.

The consumer takes whatever is newest, so lag never accumulates when it is slower than the
source; frames it never saw are counted as `overwritten`. File sources can be paced at their
real-time speed (their presentation times against the wall clock) and looped, for demos and
tests of live behaviour on recorded clips.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

from .frame import Frame


class LatestFrameGrabber:
    def __init__(self, frames: Callable[[], Iterator[Frame]], realtime: bool = True, loop: bool = False):
        """frames: a function returning a fresh iterator of the source's frames (called again to loop)."""
        self._frames, self.realtime, self.loop = frames, realtime, loop
        self._cond = threading.Condition()
        self._latest: Frame | None = None
        self._taken_index = -1
        self._stop = threading.Event()
        self.ended = False
        self.error: BaseException | None = None
        self.read = 0
        self.overwritten = 0
        self._thread = threading.Thread(target=self._run, name="vlmstream-grabber", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # The wall clock's time of pts 0, set by the first frame: counted from before the source
        # opened, its first frames came late by the opening (a file over HTTP: seconds), and were
        # stamped captured that much before they could have been.
        t0: float | None = None
        started = time.perf_counter()
        offset, last_pts, step, seq = 0.0, 0.0, 1.0 / 30, 0
        try:
            while not self._stop.is_set():
                any_frame = False
                for f in self._frames():
                    pts = offset + f.pts
                    if pts > last_pts and any_frame:  # within a pass: a pass's first frame says nothing of it
                        step = pts - last_pts
                    any_frame = True
                    last_pts = pts
                    t0 = time.perf_counter() - pts if t0 is None else t0
                    if self.realtime:
                        delay = t0 + pts - time.perf_counter()
                        if delay > 0 and self._stop.wait(delay):
                            return
                    # Captured when a live camera would have sent it: at its time on the wall
                    # clock when paced, not when it was decoded. A file decoded slower than it
                    # plays (a slow machine, a busy core) had every frame stamped late, and its
                    # end-to-end latency left out the time its captions trailed the clip by.
                    # Unpaced, the source's own time of capture (a stream's, a camera's).
                    frame = Frame(f.source_id, seq, pts, f.rgb, convert=f.convert,
                                  captured_at=t0 + pts if self.realtime else f.captured_at)
                    seq += 1
                    with self._cond:
                        if self._latest is not None and self._latest.index > self._taken_index:
                            self.overwritten += 1
                        self._latest = frame
                        self.read += 1
                        self._cond.notify_all()
                    if self._stop.is_set():
                        return
                if not (self.loop and any_frame):
                    return
                # The next loop continues the clock; a source that paces itself (a recording over
                # the network) is at least where the wall clock is: one of a single frame (a
                # camera's snapshot URL) had its times grow by its whole clock at each pass.
                offset = last_pts + step if self.realtime else max(last_pts + step, time.perf_counter() - started)
        except BaseException as e:  # reaches the consumer through get()
            self.error = e
        finally:
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    def get(self, timeout: float = 5.0) -> Frame | None:
        """The newest frame not yet taken; None once the source has ended (or on timeout). Its
        pixels may be left for the taker to convert (`Frame.load`). To tell the end from a
        timeout, read `ended` before the call: once it is True, the call gives the last frame,
        raises the source's error, or None (the end)."""
        deadline = time.perf_counter() + timeout
        with self._cond:
            while True:
                if self._latest is not None and self._latest.index > self._taken_index:
                    self._taken_index = self._latest.index
                    return self._latest
                if self.ended:
                    if self.error is not None:
                        raise self.error
                    return None
                left = deadline - time.perf_counter()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self, may_hang: bool = False) -> None:
        """Stop reading, and wait for the reading thread to end: 5 s at most, or READER_WAIT_S
        where it `may_hang` in an FFmpeg read or open that nothing cuts short (a network source,
        a hung camera: until its read or open timeout; a web viewer's Stop had waited 5 s on it).
        Such a source's Connection is stopped first: its thread ends with that call, having
        nothing more to try."""
        self._stop.set()
        self._thread.join(READER_WAIT_S if may_hang else 5.0)


READER_WAIT_S = 0.5


class PushedFrames:
    """Frames a viewer pushes (a browser's camera) as a source to pull, for a consumer that pulls
    (`LiveLocator`): `frames()` yields the newest frame pushed since the last it yielded, waits
    for one otherwise, and ends once `close()` is called."""

    def __init__(self):
        self._cond = threading.Condition()
        self._frame: Frame | None = None
        self._closed = False

    def push(self, frame: Frame) -> None:
        with self._cond:
            self._frame = frame
            self._cond.notify_all()

    def frames(self) -> Iterator[Frame]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._frame is not None or self._closed, timeout=0.5)
                if self._closed:
                    return
                frame, self._frame = self._frame, None
            if frame is not None:
                yield frame

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
