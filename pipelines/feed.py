"""A live feed: one source played through a live session, plus what a viewer needs to watch it.

Two ways in. Pull: give a function returning frame iterators (a file, a stream, a webcam); a
pump thread takes the grabber's newest frame at up to `fps` and offers it to the session. Push:
call `push(rgb)` with frames as they arrive (a browser's camera); the session's intake bound
makes the latest frame win. Either way the feed keeps, under one lock: the newest result with
the exact frame it describes, a caption log (a line per run of identical answers), per-frame
stage latencies for the last `window_s` seconds, the session's counters, the last
EXPORT_LINES answers as JSON lines (`records()`, for a download), and a small JPEG of the frame
where each of the last SHOTS changes of the answers began (what changed, and what it looked
like; a new answer counts once it has held `hold` frames).
A region task ({"detect": OBJECT} or {"point": OBJECT}, with `locate`: Moondream 2's region
protocol, one frame at a time) runs through a `LiveLocator` instead of the session, its frames
with the places drawn and its answer the count found ("person: 2 found"), for the same viewer.
`snapshot()` copies all but the records for a viewer that polls (a `FeedSnapshot`,
feed_snapshot.py); `version` grows with every result so a viewer can skip redraws when nothing
changed. The log's lines are in caption_log.py, the pictures of the changes in shot.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from engine.types import SamplingParams

if TYPE_CHECKING:  # not at run time: the command line checks its arguments before torch loads
    from engine import Engine

from .caption_log import LogLine, extend_log
from .changes import AnswerChanges
from .connection import Connection
from .grabber import LatestFrameGrabber, PushedFrames
from .live import DEFAULT_MAX_INFLIGHT, LiveSession
from .live_result import LiveResult
from .window import rolling_rate
from .frame import Frame
from .feed_snapshot import FeedSnapshot, LatencyPoint
from .shot import SHOT_QUALITY, SHOT_WIDTH, Shot, jpeg_bytes
from .sinks import json_text
from .locator import LiveLocator, Located, LocateSource

REGION_TASKS = ("detect", "point")
# Answers a feed keeps for an export: ~5 minutes at 35 captions a second, ~4 MB of JSON.
EXPORT_LINES = 10_000
# Pictures of the frames where the answers changed: a page's gallery of them stays ~200 KB; the
# full-size ones (for a download) ~1-6 MB a feed, 640x360 to 1080p.
SHOTS = 16
# Latency points the chart keeps however old, beyond its window: Moondream 2 on a CPU answers
# every ~30 s, and a 30 s window had held one bar, each answer's replacing the one before.
MIN_CHART_BARS = 10


class LiveFeed:
    def __init__(self, engine: Engine, task: dict | list[dict], params: SamplingParams,
                 frames: Callable[[], Iterator[Frame]] | None = None, realtime: bool = True, loop: bool = False,
                 fps: float = 60.0, max_inflight: int = DEFAULT_MAX_INFLIGHT, deadline_ms: float | None = None,
                 window_s: float = 30.0, log_size: int = 200, record_size: int = EXPORT_LINES,
                 shots: int = SHOTS, hold: int = 1, on_result: Callable[[LiveResult], None] | None = None,
                 connection: Connection | None = None, locate: Callable[[np.ndarray], dict] | None = None,
                 adapt: bool = True, answer_s: float | None = None):
        """hold: a new answer gets a picture once it has come this many frames in a row (as
        `live --changes --hold`): a one-frame misreading is a line of the log, not a change.
        connection: a stream's or a camera's (LiveSource.connection): its health is the counters'
        "stream", and close stops it, so that a source in an outage stops retrying.
        locate: rgb -> the region decoder's result, for a region task.
        adapt, answer_s: the session's (LiveSession): one frame in flight while answers are slow."""
        if not 0 < fps < float("inf"):  # NaN too
            raise ValueError(f"fps must be a finite number > 0, got {fps}")
        self.task, self.fps, self.window_s, self.on_result = task, fps, window_s, on_result
        self._connection = connection
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.version = 0
        self._latest: LiveResult | None = None
        self._log: deque[LogLine] = deque(maxlen=log_size)
        self._records: deque[str] = deque(maxlen=record_size)  # JSON lines, for an export
        loaded = getattr(engine, "loaded", None)  # the export's lines name their model, as `live -o`'s
        if loaded is not None:
            from engine.models.loader import model_id

            self._model = {"model": model_id(loaded.name)}
        else:
            self._model = {}
        self._shots: deque[Shot] = deque(maxlen=shots)
        self._changes = AnswerChanges(hold)
        # A constrained answer keeps its order in the log's runs and the changes (`answer_key`)
        self._in_order = any(isinstance(t, dict) and "constraint" in t for t in (task if isinstance(task, list) else [task]))
        self._run_start: LiveResult | None = None  # the first frame of the log's newest run
        self._latency: deque[LatencyPoint] = deque()
        self.error: str | None = None  # one line for a page; `exception` is what was raised
        self.exception: Exception | None = None
        self._pushed_count = 0
        self.pushed_at = time.monotonic()  # the last push (a browser's camera): a page tells a silent camera by it
        self._t0 = time.perf_counter()
        self._grabber: LatestFrameGrabber | None = None
        self._above_fps = 0  # frames the pump passed over: the source is faster than `fps`
        self._pump: threading.Thread | None = None
        self.session: LiveSession | None = None
        self._locator: LiveLocator | None = None
        self._pushed: PushedFrames | None = None
        region = [k for k in REGION_TASKS if isinstance(task, dict) and k in task]
        if region:
            if locate is None:
                raise ValueError("a region task needs `locate`")
            if frames is None:  # pushed frames: the locator pulls the newest, as from any source
                self._pushed = PushedFrames()
                frames, realtime, loop = self._pushed.frames, False, False
            what = task[region[0]]
            self._locator = LiveLocator(locate, [LocateSource("live", frames, realtime, loop)], what, region[0],
                                        fps, on_result=lambda r: self._on_result(r.drawn()))
            return
        self.session = LiveSession(engine, task, params, max_inflight, deadline_ms, on_result=self._on_result,
                                   adapt=adapt, answer_s=answer_s)
        if frames is not None:
            self._grabber = LatestFrameGrabber(frames, realtime=realtime, loop=loop)
            self._pump = threading.Thread(target=self._run_pump, name="vlmstream-feed", daemon=True)
            self._pump.start()

    @property
    def running(self) -> bool:
        if self._stop.is_set():
            return False
        if self._locator is not None:
            return self._locator.running
        return self._pump is None or self._pump.is_alive()

    def push(self, rgb: np.ndarray, source_id: str = "push") -> bool:
        """Offer one frame (H, W, 3) uint8; False if dropped (engine saturated) or the feed is closed."""
        if self._stop.is_set() or (self.session is None and self._pushed is None):
            return False
        self.pushed_at = time.monotonic()
        with self._lock:
            index, self._pushed_count = self._pushed_count, self._pushed_count + 1
        frame = Frame(source_id, index, time.perf_counter() - self._t0, rgb)
        if self._pushed is not None:  # the locator takes the newest when it is ready
            self._pushed.push(frame)
            return True
        return self.session.offer(frame)

    def _run_pump(self) -> None:
        assert self._grabber is not None
        t0, next_t = time.perf_counter(), 0.0
        try:
            while not self._stop.is_set():
                # Read before get(): once ended, get() gives the last frame or raises the source's
                # error. Read after a None, a source that failed in between was taken for a clean
                # end (`live --max-outage` exited 0 for a camera given up).
                ended = self._grabber.ended
                frame = self._grabber.get(timeout=0.5)
                if frame is None:
                    if ended:
                        break
                    continue
                now = time.perf_counter() - t0
                if now < next_t:
                    self._above_fps += 1  # the source is faster than the feed's fps
                    continue
                next_t = max(next_t + 1.0 / self.fps, now - 1.0 / self.fps)
                self.session.offer(frame.load())  # converted only now: frames passed over never are
        except Exception as e:  # a source that failed (unreachable stream, unreadable file)
            self.exception = e
            self.error = str(e).splitlines()[0] if str(e) else type(e).__name__
        finally:
            if not self._stop.is_set():  # the source ended (or failed), not the feed closed
                self.session.source_ended()
            with self._lock:
                self.version += 1

    def _on_result(self, r: LiveResult | Located) -> None:
        records = [json_text({**x, **self._model}) for x in r.records()] if self._records.maxlen else []
        t = r.timings_ms
        if isinstance(r, Located):  # the region decoder's one figure; the wait before it is the queue
            total = t.get("total", 0.0)
            stages = {"queue": r.end_to_end_ms - total, "vision": 0.0, "prefill": 0.0, "decode": total}
        else:
            stages = {"queue": t.get("queue", 0.0), "vision": t.get("preprocess", 0.0) + t.get("vision", 0.0),
                      "prefill": t.get("prefill", 0.0), "decode": t.get("decode", 0.0)}
        now = time.time()
        with self._lock:
            self._latest = r
            if extend_log(self._log, now, r.frame.pts, r.frame.index, r.text, r.end_to_end_ms, self._in_order):
                self._run_start = r
            # A change that holds dates from the first of its frames, which began the log's newest
            # run (both follow answer_key, frame by frame).
            if self._shots.maxlen and self._changes.observe(0, r.text, r.frame.pts, in_order=self._in_order) is not None:
                first = self._run_start.frame  # encoded once per change for every viewer: ~2 ms at
                # 640x360, ~19 at 1080p, under the lock so that a snapshot's log and pictures agree
                self._shots.append(Shot(self._changes.count, now, first.pts, first.index, self._run_start.text,
                                        jpeg_bytes(first.rgb, SHOT_WIDTH), jpeg_bytes(first.rgb, None, SHOT_QUALITY)))
            self._records.extend(records)
            self._latency.append(LatencyPoint(now, r.frame.index, {k: max(0.0, float(v)) for k, v in stages.items()},
                                              r.end_to_end_ms))
            while len(self._latency) > MIN_CHART_BARS and self._latency[0].wall < now - self.window_s:
                self._latency.popleft()
            self.version += 1
        on_result = self.on_result  # read once: the UI's Record off sets it to None from another thread
        if on_result:
            on_result(r)

    def set_hold(self, hold: int) -> None:
        """From the next answer on, a new answer gets a picture once it has held `hold` frames (a
        Settings Apply: a browser's camera has no Start to take it from)."""
        with self._lock:
            self._changes.hold = hold

    def continue_records(self, older: "LiveFeed") -> None:
        """Start this feed's export with the lines of the feed it replaces (a camera's new prompt:
        the same stream goes on, and its Export had held the new prompt's answers alone)."""
        lines = older.records()
        with self._lock:
            own = list(self._records)
            self._records.clear()
            self._records.extend(lines + own)  # the newest EXPORT_LINES kept

    def records(self) -> list[str]:
        """The last EXPORT_LINES answers as JSON lines (`LiveResult.records`), oldest first."""
        with self._lock:
            return list(self._records)

    def snapshot(self, full: bool = True) -> FeedSnapshot:
        """The newest result; with full=False, without log, latency history and counters (cheap
        enough for every page update, while those change the page only a couple of times a second)."""
        stats, error = {}, self.error or (self.session.error if self.session is not None else None)
        if full and self._locator is not None:
            stats = self._located_stats()
        elif full:
            stats = self.session.stats()
            stats["in_flight"] = self.session.in_flight
            if self._grabber is not None:
                # every frame read is in frames_in or one of these (`live --fps 10` of a 60 fps
                # camera had said 41 frames in of the ~240 it sent, none dropped)
                stats["overwritten_at_grab"] = self._grabber.overwritten
                stats["above_fps"] = self._above_fps
        if full and self._connection is not None:
            stats["stream"] = self._connection.health()
        if error is None and self._locator is not None:  # the decoder's error ends the run; a source's, its source
            failed = self._locator.exception
            error = ((str(failed).splitlines() or [type(failed).__name__])[0] if failed is not None
                     else self._locator.errors().get("live"))
        with self._lock:
            r = self._latest
            return FeedSnapshot(
                version=self.version, running=self.running, error=error,
                frame_rgb=None if r is None else r.frame.rgb, text="" if r is None else r.text,
                pts=0.0 if r is None else r.frame.pts, index=-1 if r is None else r.frame.index,
                end_to_end_ms=0.0 if r is None else r.end_to_end_ms,
                log=list(self._log) if full else [], latency=list(self._latency) if full else [], counters=stats,
                shots=list(self._shots) if full else [], running_s=time.perf_counter() - self._t0)

    def _located_stats(self) -> dict:
        """A located feed's counters under the names a caption feed's have: frames that came while
        the decoder worked are the stale ones, passed over."""
        st = self._locator.stats()["live"]
        with self._lock:
            now, walls = time.time(), [p.wall for p in self._latency]
        return {"completed": st["completed"], "achieved_fps": st["achieved_fps"],
                "rolling_fps": rolling_rate(walls, now), "cancelled_stale": st["overwritten"], "dropped": 0, "in_flight": 0,
                "above_fps": st["above_fps"], "latency_ms": st["latency_ms"]}

    def close(self, cancel: bool = True, timeout: float | None = 10.0) -> None:
        """Stop the source and join the threads (idempotent). cancel: drop what is in flight (a
        viewer left) instead of letting it finish (a timed run that reports every caption).
        timeout None: the frames in flight take as long as they take (a slow model's)."""
        self._stop.set()
        if self._connection is not None:
            self._connection.stop()
        if self._locator is not None:
            if self._pushed is not None:
                self._pushed.close()
            self._locator.close(30.0 if timeout is None else timeout)
            return
        if self._grabber is not None:
            self._grabber.close(may_hang=self._connection is not None)
        if self._pump is not None:
            self._pump.join(10.0 if timeout is None else timeout)
        if cancel:
            self.session.cancel_all()
        try:
            self.session.close(timeout if cancel or timeout is None else max(timeout, 30.0))
        except TimeoutError as e:  # an on_result that hangs: said where the feed's errors are
            self.error = self.error or str(e)
