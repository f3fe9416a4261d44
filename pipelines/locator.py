"""Where an object is in the newest frame of live sources (`live --detect` / `--point`).

Moondream 2's region protocol runs beside the engine (engine/region_decoder.py: a host sync a
step; the engine does not batch it), so a live run of it is latest-frame-wins at the decoder's
own pace: one worker thread takes the newest frame of every source that has one (one model serves
them all; with `locate_many`, located in one batch call, else one after the other), and reports
each frame with its places and its end-to-end latency (capture to result). Frames that arrive
while it works are overwritten, never queued, so lag does not build up; they are counted. A
source that fails (an unreachable stream, an unreadable file) ends alone, its error kept; an
error of the decoder ends the run and is raised by `check()`. `close()` stops the sources and joins every thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np

from .frame import Frame
from .grabber import LatestFrameGrabber
from .window import LatencyWindow

if TYPE_CHECKING:
    from .connection import Connection

COLOUR = (255, 60, 200)  # magenta: stands out on most scenes, and is none of the world's colours


def pixel_places(places: list[dict], width: int, height: int, task: str) -> list[list[int]]:
    """Boxes [x0, y0, x1, y1] (detect) or points [x, y] (point) in pixels, from fractions, inside
    the image: a box the model sizes past an edge (its centre near it) is cut at the edge, where
    -12 had made `rgb[y0:y1, x0:x1]` an empty crop, or one from the other side."""
    def px(v: float, n: int) -> int:
        return min(max(round(v * n), 0), n)

    if task == "detect":
        return [[px(o["x_min"], width), px(o["y_min"], height), px(o["x_max"], width), px(o["y_max"], height)]
                for o in places]
    return [[px(o["x"], width), px(o["y"], height)] for o in places]


def places_text(pixels: list[list[int]], task: str) -> str:
    """The places as a terminal shows them: (x0,y0)-(x1,y1) boxes or (x,y) points."""
    return " ".join(f"({p[0]},{p[1]})-({p[2]},{p[3]})" if task == "detect" else f"({p[0]},{p[1]})"
                    for p in pixels) or "none found"


def place_record(source: str, frame: Frame, task: str, what: str, places: list[dict], pixels: list[list[int]],
                 timings_ms: dict, batch: int | None = None) -> dict:
    """A located frame's JSON line (`video --detect -o`, `live --detect -o`, the web UI's
    downloads): the places as fractions (4 decimals) and in pixels, the frame's size, the images
    located with it (`batch`, where known) and the timings."""
    h, w = frame.rgb.shape[:2]
    return {"source": source, "index": frame.index, "pts": round(frame.pts, 6), task: what,
            ("objects" if task == "detect" else "points"): [{k: round(v, 4) for k, v in o.items()} for o in places],
            "pixels": pixels, "width": w, "height": h, **({"batch": batch} if batch is not None else {}),
            "timings_ms": timings_ms}


def found_text(what: str, n: int) -> str:
    """The number found, as a recording, a subtitle or the web UI says it."""
    return f"{what}: {n} found" if n else f"{what}: none found"


def batched(items: Iterable, n: int) -> Iterator[list]:
    """Lists of up to n consecutive items (the last may be shorter), as they come: frames for
    `RegionDecoder.locate_batch` without holding a whole video."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def count_change(changes, key, found: int, pts: float, keep: object = None) -> dict | None:
    """`--changes` for places: the number found is the answer followed (boxes jitter from frame to
    frame; an object coming or going is the event). The fields a reported line adds (`previous`:
    the number it replaces, null for the first; `since`: the pts it first came at), or None.
    `keep` (what the snapshot is drawn from) comes back as `kept` where this frame began the
    change (`AnswerChanges.observe`): not a field of the line."""
    c = changes.observe(key, str(found), pts, keep)
    if c is None:
        return None
    return {"previous": None if c.previous is None else int(c.previous), "since": round(c.since_pts, 6),
            "kept": c.since_kept}


def draw(rgb: np.ndarray, pixels: list[list[int]], task: str) -> np.ndarray:
    """The frame with each box (or point) drawn, two pixels wide on a dark outline."""
    import cv2

    img = np.ascontiguousarray(rgb).copy()
    r = max(3, min(img.shape[:2]) // 80)
    for p in pixels:
        for colour, width in (((0, 0, 0), 4), (COLOUR, 2)):
            if task == "detect":
                cv2.rectangle(img, (p[0], p[1]), (p[2], p[3]), colour, width)
            else:
                cv2.circle(img, (p[0], p[1]), r, colour, width)
    return img


@dataclass
class LocateSource:
    label: str
    frames: Callable[[], Iterator[Frame]]  # a fresh iterator of the source's frames at each call
    realtime: bool = True  # pace a file's frames by their times
    loop: bool = False  # play a file again from its start when it ends
    connection: Connection | None = None  # a stream's or a camera's: stopped on close, its health in stats


@dataclass
class Located:
    """One frame's places (fractions of the frame, and pixels), as the decoder gave them."""

    label: str
    frame: Frame
    what: str
    task: str
    places: list[dict]
    pixels: list[list[int]]
    timings_ms: dict[str, float]
    end_to_end_ms: float  # from the frame's capture to its places
    batch: int | None = None  # the frames located in the same call (one per source that had one)

    @property
    def text(self) -> str:  # what a recording draws under the frame (pipelines/recorder.py)
        return found_text(self.what, len(self.places))

    def drawn(self) -> "Located":
        """The same, its frame with the places drawn on it (for a recording, a page, a picture)."""
        return replace(self, frame=replace(self.frame, rgb=draw(self.frame.rgb, self.pixels, self.task)))

    def records(self) -> list[dict]:
        """The line of a live log (`live --detect -o`, the web UI's export): the places as
        fractions and in pixels, the UTC time (taken now: call it when the result arrives), and
        the timings with the end-to-end latency."""
        from datetime import datetime, timezone

        record = place_record(self.label, self.frame, self.task, self.what, self.places, self.pixels,
                              {**self.timings_ms, "end_to_end": round(self.end_to_end_ms, 3)}, self.batch)
        return [{**record, "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds")}]


@dataclass
class _State:
    source: LocateSource
    grabber: LatestFrameGrabber
    next_t: float = 0.0
    completed: int = 0
    above_fps: int = 0
    ended: bool = False
    ended_at: float | None = None  # perf_counter when it ended: its frame rate's time stops there
    located_at: float = 0.0  # perf_counter of its last frame located
    error: str | None = None  # one line
    exception: BaseException | None = None
    latency: dict[str, LatencyWindow] = field(default_factory=lambda: {k: LatencyWindow()
                                                                       for k in ("locate", "end_to_end")})


class LiveLocator:
    def __init__(self, locate: Callable[[np.ndarray], dict], sources: list[LocateSource], what: str,
                 task: str = "detect", fps: float = 60.0, on_result: Callable[[Located], None] | None = None,
                 locate_many: Callable[[list[np.ndarray]], list[dict]] | None = None):
        """locate: rgb -> the decoder's result ({"objects" or "points": [...], "timings_ms": {...}}).
        locate_many: several frames -> their results, as `locate` gives each (the region decoder's
        `locate_batch`): each pass then locates the newest frame of every source that has one in a
        single call, so that with several cameras each waits ~one batch, not one decode per camera.
        on_result runs on the worker thread, once per located frame, in each source's frame order."""
        if task not in ("detect", "point"):
            raise ValueError(f"task must be detect or point, got {task!r}")
        if not 0 < fps < float("inf"):  # NaN too
            raise ValueError(f"fps must be a finite number > 0, got {fps}")
        self._locate_many = locate_many or (lambda rgbs: [locate(rgb) for rgb in rgbs])
        self.what, self.task, self.fps, self.on_result = what, task, fps, on_result
        self._key = "objects" if task == "detect" else "points"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.exception: BaseException | None = None  # the decoder's (or on_result's): the run ended
        self._t0 = time.perf_counter()
        self._closed_at: float | None = None
        self._states = [_State(s, LatestFrameGrabber(s.frames, realtime=s.realtime, loop=s.loop)) for s in sources]
        self._thread = threading.Thread(target=self._run, name="vlmstream-locator", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def errors(self) -> dict[str, str]:
        """label -> the one-line error of each source that failed."""
        return {s.source.label: s.error for s in self._states if s.error}

    def going(self) -> set[str]:
        """The labels of the sources that have not ended."""
        return {s.source.label for s in self._states if not s.ended}

    def exceptions(self) -> dict[str, BaseException]:
        return {s.source.label: s.exception for s in self._states if s.exception is not None}

    def check(self) -> None:
        """Raise the error that ended the run, if the decoder failed."""
        if self.exception is not None:
            raise self.exception

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                ready: list[tuple[_State, Frame]] = []  # the newest frame of each source that has one
                for s in self._states:
                    if s.ended or self._stop.is_set():
                        continue
                    ended = s.grabber.ended  # read before get(), as LiveFeed's pump does (why there)
                    try:
                        frame = s.grabber.get(timeout=0.0)
                    except Exception as e:  # the source failed: it ends, the others go on
                        s.ended, s.ended_at, s.exception = True, time.perf_counter(), e
                        s.error = str(e).splitlines()[0] if str(e) else type(e).__name__
                        continue
                    if frame is None:
                        s.ended = ended  # every frame it had was taken, and located, before
                        s.ended_at = time.perf_counter() if ended else None
                        continue
                    now = time.perf_counter()
                    if now < s.next_t:
                        s.above_fps += 1  # the source is faster than --fps
                        continue
                    s.next_t = max(s.next_t + 1.0 / self.fps, now - 1.0 / self.fps)
                    ready.append((s, frame.load()))
                if ready:
                    results = self._locate_many([frame.rgb for _, frame in ready])
                    for (s, frame), result in zip(ready, results):
                        self._one(s, frame, result)
                if all(s.ended for s in self._states):
                    break
                if not ready:
                    self._stop.wait(0.005)  # no source has a new frame yet
        except BaseException as e:  # the decoder failed: the run ends and the caller hears of it
            self.exception = e
        finally:
            # Done with it: a stopped feed kept for its results (the UI's Export) held the region
            # decoder, and through it a reloaded model's weights, until its tab closed.
            self._locate_many = None

    def _one(self, s: _State, frame: Frame, result: dict) -> None:
        end_to_end = (time.perf_counter() - frame.captured_at) * 1000.0
        places = result[self._key]
        h, w = frame.rgb.shape[:2]
        r = Located(s.source.label, frame, self.what, self.task, places, pixel_places(places, w, h, self.task),
                    dict(result["timings_ms"]), end_to_end, result.get("batch"))
        if self.on_result is not None:
            self.on_result(r)
        with self._lock:  # counted once delivered: a count seen has its results where on_result put them
            s.completed += 1
            s.located_at = time.perf_counter()
            s.latency["locate"].append(float(r.timings_ms.get("total", 0.0)))
            s.latency["end_to_end"].append(end_to_end)

    def stats(self) -> dict[str, dict]:
        """label -> frames read, located, overwritten unseen (the decoder was busy), skipped above
        --fps, frames located a second, latency percentiles (ms), and a stream's health."""
        now = time.perf_counter()
        out = {}
        with self._lock:
            for s in self._states:
                g = s.grabber
                # a source that ended is rated over its own time, as live's (LiveSession.source_ended):
                # `live short.mp4 long.mp4 --detect` rated the short one over the long one's time
                # Closed (--duration, a page's Stop), up to the close or the frame located after it,
                # as LiveSession.stats: a stopped feed's rate had fallen on with the time since.
                end = s.ended_at or (max(self._closed_at, s.located_at) if self._closed_at else now)
                wall = max(end - self._t0, 1e-9)
                st = {"frames_in": g.read, "completed": s.completed, "overwritten": g.overwritten,
                      "above_fps": s.above_fps, "achieved_fps": s.completed / wall,
                      "latency_ms": {k: v.percentiles() for k, v in s.latency.items() if v}}
                if s.source.connection is not None:
                    st["stream"] = s.source.connection.health()
                out[s.source.label] = st
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Stop the sources and the worker (a frame being located is finished first); idempotent."""
        self._closed_at = self._closed_at or time.perf_counter()
        self._stop.set()
        for s in self._states:
            if s.source.connection is not None:
                s.source.connection.stop()
            s.grabber.close(may_hang=s.source.connection is not None)
        self._thread.join(timeout)
