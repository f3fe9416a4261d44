"""A recording of a live session (`live --annotate`): each completed frame with its answers and
its end-to-end latency drawn, in an H.264 MP4, shown from the time the frame was captured until
the next completed one, the last one until `close()` (or, `hold_to_close=False`, until its
answer came: a browser camera's recording, closed when it is downloaded, maybe minutes after the
camera stopped) (a variable frame rate: frames dropped at intake or cancelled as stale are not in
it, as they never had a caption).

Encoding runs on a thread of its own behind a bounded queue, so the session never waits on it;
a frame that finds the queue full is left out of the recording and counted (`skipped`), as are
frames captured more than `max_seconds` after the first (`full` then says so). An error
(a full disk) ends the recording and is kept in `error` for the caller; `close()` finishes the
file (what was written plays). The MP4 is fragmented: if the process dies before `close()`, all but
the last second or so still plays.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from pathlib import Path

from .live_result import LiveResult
from .annotated import AnnotatedVideoSink

QUEUE_FRAMES = 120  # two seconds at 60 fps


class Recorder:
    def __init__(self, path: str | Path, queue_frames: int = QUEUE_FRAMES, max_seconds: float | None = None,
                 hold_to_close: bool = True):
        self.path, self.max_seconds, self.hold_to_close = Path(path), max_seconds, hold_to_close
        self.written = self.skipped = 0
        self.full = False
        self._closed = False
        # add() and close() from two threads: a frame that passed the closed check was queued
        # after the end mark, neither written nor counted as skipped. Reentrant: a close() at
        # exit or from a signal handler may interrupt an add() on its own thread.
        self._adding = threading.RLock()
        self.error: Exception | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=queue_frames)
        self._t0: float | None = None
        self._end: float | None = None  # when close() came, in the frames' capture clock (perf_counter)
        self._answered: float | None = None  # when the last frame recorded was added (its answer came)
        self._thread = threading.Thread(target=self._run, name="vlmstream-recorder", daemon=True)
        self._thread.start()
        # Finished at the interpreter's exit if no one closed it: a Ctrl-C while `live` closed its
        # outputs skipped close(), and the daemon thread died with the last second unwritten.
        atexit.register(self.close)

    def add(self, r: LiveResult) -> None:
        """A completed frame (from the session's result callback: never blocks for long)."""
        with self._adding:  # queued before close()'s end mark, or not at all
            self._add(r)

    def _add(self, r: LiveResult) -> None:
        if self._closed or self.error is not None or r.frame.rgb is None:
            return
        if self._t0 is None:
            self._t0 = r.frame.captured_at
        seconds = r.frame.captured_at - self._t0
        if self.max_seconds is not None and seconds > self.max_seconds:
            self.full = True
            self.skipped += 1
            return
        item = (r.frame.rgb, r.text, f"#{r.frame.index}  {r.end_to_end_ms:.0f} ms", seconds)
        try:
            self._queue.put_nowait(item)
            self._answered = time.perf_counter()
        except queue.Full:
            self.skipped += 1

    def _run(self) -> None:
        sink = None
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.5)
                except queue.Empty:
                    if self._closed:  # close() could not queue its end mark yet: nothing more comes
                        break
                    continue
                if item is None:
                    break
                rgb, text, info, seconds = item
                if sink is None:
                    # fragmented: a recording the process never got to finish (killed, power lost) still plays
                    sink = AnnotatedVideoSink(self.path, rgb.shape[1], rgb.shape[0], fragmented=True)
                sink.write_image(rgb, text, info, seconds)
                self.written += 1
        except Exception as e:  # the disk filled, the folder went away: the session goes on without
            self.error = e
        finally:
            if sink is not None:
                try:
                    # The last frame stays on screen until the recording ended, as it did for a
                    # viewer: it had lasted 1 ms (a session's last answer never seen in its
                    # recording, a one-frame recording 0.001 s long). Not past max_seconds.
                    stop = self._end if self.hold_to_close else self._answered
                    end = None if stop is None or self._t0 is None else stop - self._t0
                    if end is not None and self.max_seconds is not None:
                        end = min(end, self.max_seconds)
                    sink.close(end)
                except Exception as e:
                    self.error = self.error or e

    def close(self, timeout: float = 60.0) -> None:
        """Encode what is queued, finish the file, join the thread (idempotent). Frames added
        afterwards are ignored."""
        atexit.unregister(self.close)  # a server makes many: none kept for the exit once closed
        with self._adding:
            if not self._closed:  # a second close (at exit) is no later end
                self._end = time.perf_counter()
            self._closed = True
        deadline = time.monotonic() + timeout
        while self._thread.is_alive():
            try:
                self._queue.put(None, timeout=0.5)
                break
            except queue.Full:  # still encoding what was queued (or stopped by an error: see is_alive)
                if time.monotonic() > deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self.error = self.error or TimeoutError(f"the recording did not finish within {timeout:.0f} s")
