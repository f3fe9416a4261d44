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

A source's outages (`outage`, from its Connection's `on_outage`) are marked, so that a reviewer
sees the picture was not live: from the last frame before an outage to the first after it, its
last recorded picture is shown darkened, "STREAM LOST at 02:13:05 UTC: no frames for 41.2 s, back
at 02:13:46 UTC" in a red band at the top (a card: placed once the first frame after it is added,
since the frames captured before it may still be answered meanwhile), and the frames captured in
the NOTE_S seconds after it carry "stream lost for 41.2 s (02:13:05 UTC to 02:13:46 UTC)" there.
One still going on at `close()`, or given up (`--max-outage`), gets its card to the recording's
end (given up: to the moment it was).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .live_result import LiveResult
from .annotated import AnnotatedVideoSink
from .outage import Outage

QUEUE_FRAMES = 120  # two seconds at 60 fps
NOTE_S = 2.0  # the frames captured this long after an outage carry its note
CARD_DIM = 0.4  # an outage's card shows the last picture at this brightness: not live


class _Item(NamedTuple):
    rgb: np.ndarray
    text: str
    info: str
    seconds: float
    note: str | None = None
    dim: bool = False


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
        self._last: tuple[np.ndarray, str] | None = None  # the last frame queued (picture, answers): a card shows it
        self._open: Outage | None = None  # an outage going on (or given up): its card comes at close()
        self._due: list[Outage] = []  # outages over whose card waits for the first frame after them
        self._notes: list[Outage] = []  # outages whose note the frames after them carry (NOTE_S)
        self._thread = threading.Thread(target=self._run, name="vlmstream-recorder", daemon=True)
        self._thread.start()
        # Finished at the interpreter's exit if no one closed it: a Ctrl-C while `live` closed its
        # outputs skipped close(), and the daemon thread died with the last second unwritten.
        atexit.register(self.close)

    def add(self, r: LiveResult) -> None:
        """A completed frame (from the session's result callback: never blocks for long)."""
        with self._adding:  # queued before close()'s end mark, or not at all
            self._add(r)

    def outage(self, outage: Outage) -> None:
        """News of an outage of the source (`Connection.on_outage`; any thread)."""
        with self._adding:
            self._open = None if outage.end is not None else outage
            if outage.end is not None:
                self._due.append(outage)

    def _add(self, r: LiveResult) -> None:
        if self._closed or self.error is not None or r.frame.rgb is None:
            return
        captured = r.frame.captured_at
        if self._t0 is None:
            self._t0 = captured
        # No frame comes in an outage: one captured past its middle came after it (the last one
        # before it was captured at its start, the first after at its end)
        while self._due and captured > (self._due[0].start + self._due[0].end) / 2:
            outage = self._due.pop(0)
            self._card(outage, outage.card())
            self._notes.append(outage)
        self._notes = [o for o in self._notes if captured - o.end < NOTE_S]
        note = "\n".join(o.back() for o in self._notes) or None
        self._put(_Item(r.frame.rgb, r.text, f"#{r.frame.index}  {r.end_to_end_ms:.0f} ms", captured - self._t0, note))

    def _card(self, outage: Outage, text: str) -> None:
        """The outage's card, from its start: the last picture recorded, darkened (none before it: no card)."""
        if self._last is not None and self._t0 is not None:
            rgb, answers = self._last
            self._put(_Item(rgb, answers, "no frames", max(0.0, outage.start - self._t0), text, dim=True))

    def _put(self, item: _Item) -> None:
        if self.max_seconds is not None and item.seconds > self.max_seconds:
            self.full = True
            self.skipped += 1
            return
        try:
            self._queue.put_nowait(item)
            self._answered = time.perf_counter()
            if not item.dim:
                self._last = (item.rgb, item.text)
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
                rgb = (item.rgb * CARD_DIM).astype(np.uint8) if item.dim else item.rgb
                if sink is None:
                    # fragmented: a recording the process never got to finish (killed, power lost) still plays
                    sink = AnnotatedVideoSink(self.path, rgb.shape[1], rgb.shape[0], fragmented=True)
                sink.write_image(rgb, item.text, item.info, item.seconds, item.note)
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

    def _last_card(self) -> None:
        """The card of an outage that the recording ends in: to its end, or to when the source was
        given up (a recording that ends with its last answer, `hold_to_close` False, gets none
        otherwise: it ends before the outage)."""
        outage = self._open
        if outage is None or not (self.hold_to_close or outage.gave_up is not None):
            return
        self._card(outage, outage.card(now=self._end))
        if outage.gave_up is not None and not self.hold_to_close:
            self._answered = outage.gave_up  # the recording ends there

    def close(self, timeout: float = 60.0) -> None:
        """Encode what is queued, finish the file, join the thread (idempotent). Frames added
        afterwards are ignored."""
        atexit.unregister(self.close)  # a server makes many: none kept for the exit once closed
        with self._adding:
            if not self._closed:  # a second close (at exit) is no later end
                self._end = time.perf_counter()
                self._last_card()
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
