"""What the web UI serves, without the web: one engine per process, shared by every browser tab.

The engine is created on first use (importing this module loads nothing heavy) and rebuilt when
the model or device setting changes. Each browser tab is a session id; a session owns at most one
pulled live feed (a file, stream or webcam on the server) and one pushed feed (its browser's
camera); closing the tab closes both and cancels their requests. Single images and video files go
through the same engine via the pipelines' public functions. Every user mistake raises `UIError`
(or a `VlmstreamError`) with a one-line message for the page.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

import numpy as np

from app.errors import UIError
from app.samples import SAMPLES_DIR, sample_videos, samples_dir
from app.settings import Settings, checked
from app.video_jobs import VideoJobs
from pipelines.frame import AS_SHOWN, Reading

# The names of this module, some of them from the modules they moved to: app.ui, the tests and the
# scripts import them from here.
__all__ = ["CLOSED_KEPT", "LIVE_FPS", "RATE_WINDOW_S", "RECORD_MAX_S", "SAMPLES_DIR", "Service", "Settings",
           "UIError", "sample_videos", "samples_dir"]

LIVE_FPS = 60.0
RATE_WINDOW_S = 3.0  # engine tokens/s and busy % shown in the UI are over about this long
# A live recording (the Live tab's Record box) keeps the first this many seconds: ~1 MB a minute
# at 640x360 (the 60 fps sample: 2.8 MB for 150 s). One per tab, replaced by its next one,
# removed with the tab.
RECORD_MAX_S = 600.0
CLOSED_KEPT = 10_000  # closed sessions remembered, so that a late event cannot bring one back


class Service:
    def __init__(self, settings: Settings = Settings(), reading: Reading = AS_SHOWN):
        """reading: how every source of this server is read (`pipelines.frame.Reading`; default
        as a player shows it); fixed for the server (`ui --no-deinterlace / --no-tonemap`)."""
        self.settings = settings
        self.reading = reading
        self._lock = threading.RLock()
        self._engine = None
        self._feeds: dict[tuple[str, str], object] = {}  # (session, "pull" | "push") -> LiveFeed
        self._ended: dict[tuple[str, str], object] = {}  # the last stopped feed of each, for an export
        self._history: deque = deque(maxlen=4096)  # engine stats snapshots behind the current rates
        self.jobs = VideoJobs()  # video jobs' turns and stop flags; the folder of every output
        self._recorders: dict[tuple[str, str], object] = {}  # (session, "pull" | "push") -> its feed's Recorder
        self._cam_record: dict[str, bool] = {}  # session -> its camera's Record box, as last seen
        self._starting: dict[str, threading.Lock] = {}  # session -> held while a Start of it runs
        self._region: tuple | None = None  # (engine, its RegionDecoder, a lock: one call at a time)
        self._closed: OrderedDict[str, None] = OrderedDict()  # the sessions closed last, oldest first

    # ---------------------------------------------------------------- engine and settings
    def engine(self):
        with self._lock:
            if self._engine is None:
                from engine import Engine, EngineConfig

                self._engine = Engine(EngineConfig(model=self.settings.model, device=self.settings.device,
                                                   dtype=self.settings.dtype,
                                                   pipeline_depth=2 if self.settings.pipelined else 1))
            return self._engine

    def params(self):
        from engine import SamplingParams

        s = self.settings
        # Sticky answers are greedy ones; live feeds and video jobs bring the drafts (a single image has none).
        return SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens,
                              sticky=s.sticky if s.temperature == 0 else 0.0)

    def apply(self, settings: Settings) -> str:
        """Change settings; a new model or device stops every feed and reloads the engine. One
        that cannot load is said before anything stops (every tab's feeds and jobs stopped for a
        mistyped model folder)."""
        settings = checked(settings)
        with self._lock:
            old = self.settings
            reload = (old.model, old.device, old.dtype) != (settings.model, settings.device, settings.dtype)
            if reload:
                from engine.models.loader import check_model

                check_model(settings.model, settings.device, settings.dtype)
            self.settings = settings
            if reload:
                self.close()
                try:
                    self.engine()
                except Exception:
                    self.settings = old
                    raise
            else:
                if self._engine is not None and old.pipelined != settings.pipelined:
                    self._engine.set_pipeline_depth(2 if settings.pipelined else 1)
                    self._engine.reset_stats()
                # feeds that run take them from their next frame (they had kept theirs until a new Start)
                for feed in self._feeds.values():
                    if feed.session is not None:
                        feed.session.set_params(self.params())
        return "engine reloaded" if reload else "settings applied"

    def engine_stats(self) -> dict:
        """The engine's figures now: tokens/s and busy % over the last few seconds, not since start."""
        with self._lock:
            if self._engine is None:
                return {}
            s = self._engine.stats()
            history = self._history
            history.append(s)
            while len(history) > 1 and s.wall_seconds - history[1].wall_seconds >= RATE_WINDOW_S:
                history.popleft()
            first = history[0]
            if first.wall_seconds > s.wall_seconds or first.tokens > s.tokens:  # counters were reset
                history.clear()
                history.append(s)
                first = s
        dt = s.wall_seconds - first.wall_seconds
        tokens_per_s = (s.tokens - first.tokens) / dt if dt > 0.2 else s.tokens_per_s
        busy = (s.busy_seconds - first.busy_seconds) / dt if dt > 0.2 else s.device_busy_fraction
        vision = (s.vision_busy_seconds - first.vision_busy_seconds) / dt if dt > 0.2 else 0.0
        stats = {"batch": s.running, "waiting": s.waiting, "tokens_per_s": round(tokens_per_s, 1),
                 "device_busy_pct": round(100 * min(max(busy, 0.0), 1.0), 1), "kv_pages_in_use": s.kv_pages_in_use,
                 "kv_pages_total": s.kv_pages_total, "prefixes_dropped": s.prefixes_dropped, "steps": s.steps,
                 "mode": "pipelined" if self.settings.pipelined else "blocking"}
        if s.vision_busy_seconds:  # a CPU engine's vision thread (CUDA encodes in the device's steps)
            stats["vision_busy_pct"] = round(100 * min(max(vision, 0.0), 1.0), 1)
        return stats

    # ---------------------------------------------------------------- live feeds
    def start_live(self, session: str, source: str, task: dict, record: bool = False) -> object:
        """Start (or restart) this session's live feed from a sample name, file path, URL or webcam
        index; with `record`, its completed frames are recorded (`recording()` gives the MP4)."""
        source = (source or "").strip()
        if not source:
            raise UIError("choose a source")
        # One Start of a session at a time: a double click runs two, and without this both stopped
        # the old feed, both started one, and the feed installed first played on for nobody (its
        # source round and round), with its recording on the same file as the other's. Per
        # session, so that a slow network source delays no other viewer's Start.
        with self._lock:
            self._check_open(session)
            starting = self._starting.setdefault(session, threading.Lock())
        with starting:
            # A close_session that came between the two found no feed to stop: one started now
            # would play on for nobody.
            with self._lock:
                self._check_open(session)
            return self._start_live(session, source, task, record)

    def _start_live(self, session: str, source: str, task: dict, record: bool) -> object:
        from pipelines.feed import LiveFeed
        from pipelines.recorder import Recorder
        from pipelines.sources import open_live
        from pipelines.webcam import parse_webcam

        self.stop_live(session)
        if source in sample_videos():
            source = str(SAMPLES_DIR / source)
        try:
            missing = parse_webcam(source) is None and "://" not in source and not Path(source).is_file()
            folder = missing and Path(source).is_dir()
        except OSError as e:  # a name past the file system's limit: its [Errno 36] repeated it whole
            from engine.errors import shortened

            raise UIError(f"no such file: {shortened(source)} ({e.strerror})") from None
        if missing:
            raise UIError(f"{source} is a folder, not a video" if folder else f"no such file: {source}")
        live = open_live(source, reading=self.reading)  # a recording (a file, or one over the network) plays as if live, round and round
        recorder = None
        if record:
            self._drop_recording(session, "pull")
            recorder = Recorder(self.jobs.recording_path("live"), max_seconds=RECORD_MAX_S)
        engine = self.engine()
        try:
            feed = LiveFeed(engine, task, self.params(), live.frames, realtime=live.paced, loop=live.loops,
                            fps=LIVE_FPS, hold=self.settings.hold, on_result=recorder.add if recorder else None,
                            connection=live.connection, locate=self._region_of(task))
        except BaseException:
            if recorder is not None:
                recorder.close()
            raise
        with self._lock:
            # Settings may have reloaded the model since engine() above: apply() closed every feed
            # it found, not this one, and the engine it was built on
            stale = self._engine is not engine
            if not stale:
                self._feeds[(session, "pull")] = feed
                if recorder is not None:
                    self._recorders[(session, "pull")] = recorder
                if feed.session is not None:  # an apply() meanwhile that needed no reload
                    feed.session.set_params(self.params())
                self._share_inflight()
        if stale:
            feed.close()
            if recorder is not None:
                recorder.close()
                recorder.path.unlink(missing_ok=True)
            raise UIError("the engine was reloaded (Settings) while this Start opened its source: Start again")
        return feed

    def recording(self, session: str, kind: str = "pull") -> Path:
        """The MP4 of this session's recorded live feed ("pull") or camera ("push"). A recording
        still running ends here (the feed goes on unrecorded): the file is complete when it is
        handed over."""
        with self._lock:
            recorder = self._recorders.get((session, kind))
            feed = self._feeds.get((session, kind))
            if feed is not None and recorder is not None and feed.on_result == recorder.add:
                feed.on_result = None
        if recorder is None:
            raise UIError("nothing recorded: tick Record, then Start" if kind == "pull" else
                          "nothing recorded: tick Record while your camera streams")
        recorder.close()
        if recorder.error is not None:
            raise UIError(f"the recording failed: {recorder.error}")
        if not recorder.written:
            raise UIError("nothing recorded yet: no frame was captioned")
        return recorder.path

    def _drop_recording(self, session: str, kind: str) -> None:
        with self._lock:
            recorder = self._recorders.pop((session, kind), None)
        if recorder is not None:
            recorder.close()
            recorder.path.unlink(missing_ok=True)

    def feed(self, session: str, kind: str = "pull"):
        with self._lock:
            return self._feeds.get((session, kind))

    def stop_live(self, session: str, kind: str = "pull") -> None:
        with self._lock:
            feed = self._feeds.pop((session, kind), None)
            if feed is not None:
                self._ended[(session, kind)] = feed
            self._share_inflight()
            recorder = self._recorders.get((session, kind))
        if feed is not None:
            feed.close()
        if recorder is not None:  # the file is finished, kept for a download
            recorder.close()

    def push_frame(self, session: str, rgb: np.ndarray, task: dict, record: bool = False) -> object:
        """A browser camera frame; the session's pushed feed starts on the first one. Ticking
        `record` (or streaming with it ticked) starts a recording of the camera's captioned frames,
        replacing the last; unticking it finishes the file, kept for `recording(session, "push")`."""
        from engine.request import as_rgb
        from pipelines.feed import LiveFeed
        from pipelines.recorder import Recorder

        rgb = as_rgb(rgb)  # an ImageError for what is no picture (a grey float frame was a cv2 error)
        key, finished = (session, "push"), None
        with self._lock:
            self._check_open(session)
            feed = self._feeds.get(key)
            if feed is None or feed.task != task:  # a new prompt starts a new feed
                new = LiveFeed(self.engine(), task, self.params(), hold=self.settings.hold, locate=self._region_of(task))
                if feed is not None:
                    new.on_result = feed.on_result  # a recording goes on across the change
                    new.continue_records(feed)  # and so does the camera's Export
                    self._ended[key] = feed
                    feed.close()
                feed = self._feeds[key] = new
                self._share_inflight()
            was, self._cam_record[session] = self._cam_record.get(session, False), record
            if record and not was:
                self._drop_recording(session, "push")  # the last one (finished: unticked or downloaded)
                recorder = self._recorders[key] = Recorder(self.jobs.recording_path("camera"),
                                                           max_seconds=RECORD_MAX_S)
                feed.on_result = recorder.add
            elif was and not record:
                feed.on_result, finished = None, self._recorders.get(key)
        if finished is not None:
            finished.close()  # kept for a download
        feed.push(rgb, source_id="browser camera")
        return feed

    def _check_open(self, session: str) -> None:
        """A session's page is gone once closed: a camera frame that arrives after its unload
        would start a feed that nobody closes (and that takes a share of every viewer's frames)."""
        if session in self._closed:
            raise UIError("this page was closed: reload it")

    def _share_inflight(self) -> None:
        """Every open feed gets an equal share of DEFAULT_MAX_INFLIGHT frames in flight (at least
        one): the engine's total in flight sets latency, not throughput (BENCHMARKS.md, several live
        sources), so a second viewer halves each one's share rather than doubling everyone's wait.
        Called with the lock held."""
        from pipelines.live import DEFAULT_MAX_INFLIGHT

        captioning = [f for f in self._feeds.values() if f.session is not None]  # a located feed is not in the engine
        share = max(1, DEFAULT_MAX_INFLIGHT // max(1, len(captioning)))
        for feed in captioning:
            feed.session.set_max_inflight(share)

    def _feeds_to_export(self, session: str, kind: str) -> list:
        """The session's running feed of that kind, then the last one it stopped (either may be absent)."""
        with self._lock:
            return [f for f in (self._feeds.get((session, kind)), self._ended.get((session, kind))) if f]

    def export_log(self, session: str, kind: str = "pull") -> Path:
        """The captions of the session's live feed ("pull": a source, "push": its camera), or of
        the last one it stopped, as a JSONL file among the kept outputs: the last EXPORT_LINES
        answers, one `LiveResult.records` line each."""
        lines = next((r for r in (f.records() for f in self._feeds_to_export(session, kind)) if r), None)
        if not lines:
            raise UIError("nothing captioned yet: start a live source first" if kind == "pull" else
                          "nothing captioned yet: start your camera first")
        return self._export("live-captions.jsonl",
                            lambda path: path.write_text("\n".join(lines) + "\n", encoding="utf-8"))

    def export_shots(self, session: str, kind: str = "pull") -> Path:
        """The change pictures of the session's live feed (or of the last one it stopped) at full
        size, as a ZIP among the kept outputs: `change_NNNN_frame_I.jpg` each, and `changes.jsonl`
        with a line per picture (its change number, UTC time, stream time, frame index, answers,
        file name)."""
        import zipfile
        from datetime import datetime, timezone

        shots = next((x for x in (f.snapshot().shots for f in self._feeds_to_export(session, kind)) if x), None)
        if not shots:
            raise UIError("no changes yet: start a live source first" if kind == "pull" else
                          "no changes yet: start your camera first")

        def write(path: Path) -> None:
            lines = []
            with zipfile.ZipFile(path, "w") as z:
                for shot in shots:
                    name = f"change_{shot.number:04d}_frame_{shot.index}.jpg"
                    z.writestr(name, shot.full)  # JPEG: stored, not compressed again
                    when = datetime.fromtimestamp(shot.wall, timezone.utc).isoformat(timespec="milliseconds")
                    lines.append(json.dumps({"number": shot.number, "time": when, "pts": round(shot.pts, 6),
                                             "index": shot.index, "text": shot.text, "file": name},
                                            ensure_ascii=False))
                z.writestr("changes.jsonl", "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED)

        return self._export("live-changes.zip", write)

    def _export(self, name: str, write: Callable[[Path], None]) -> Path:
        """A file for a download, among the kept outputs. One the server's disk cannot take is a
        UIError (a full disk had shown the page a bare "[Errno 28]" and left a part file)."""
        path = None
        try:
            path = self.jobs.new_folder() / name
            write(path)
        except OSError as e:
            if path is not None:
                path.unlink(missing_ok=True)
            raise UIError(f"cannot write {name} on the server: {e.strerror or e}") from None
        return path

    def close_session(self, session: str) -> None:
        with self._lock:
            self._closed[session] = None
            while len(self._closed) > CLOSED_KEPT:
                self._closed.popitem(last=False)
        self.jobs.cancel(session)
        with self._lock:
            # a Start still opening its source would install its feed after us: wait for it
            starting = self._starting.get(session) or contextlib.nullcontext()
        with starting:
            for kind in ("pull", "push"):
                self.stop_live(session, kind)
                with self._lock:
                    self._ended.pop((session, kind), None)
        for kind in ("pull", "push"):
            self._drop_recording(session, kind)
        with self._lock:
            self._cam_record.pop(session, None)
            self._starting.pop(session, None)

    # ---------------------------------------------------------------- one image, one video
    def caption_image(self, rgb: np.ndarray, task: dict | list[dict]) -> dict:
        from pipelines.prompts import INTERACTIVE, answers_text, ask

        from engine.models.prompt import asked_prompt

        from engine.errors import EngineClosedError

        tasks = [task] if isinstance(task, dict) else task
        engine = self.engine()
        again = "the engine was reloaded (Settings) while this image was asked: ask again"
        try:
            # as long as the engine makes progress: a slow model beside a video job takes minutes
            outs = [h.wait() for h in ask(engine, rgb, tasks, self.params(), priority=INTERACTIVE)]
        except EngineClosedError:
            raise UIError(again) from None
        # a reload cancels what is in flight: its empty answers had come back as an answer ('q0?: ')
        if any(o.finish_reason == "cancelled" for o in outs):
            raise UIError(again)
        if any(o.finish_reason == "error" for o in outs):
            raise UIError("the engine failed while this image was asked (the server's log says why)")

        def asked(t: dict) -> dict:  # what the model was asked, where its config rewords a question
            return {"asked": asked_prompt(engine.model_config, t["question"])} if "question" in t else {}

        if isinstance(task, dict):
            return {"text": outs[0].text.strip(), **asked(task), "finish_reason": outs[0].finish_reason,
                    "timings_ms": outs[0].timings_ms}
        return {"text": answers_text(task, [o.text for o in outs]),
                "answers": [{"question": t["question"], **asked(t), "text": o.text.strip(),
                             "finish_reason": o.finish_reason, "timings_ms": o.timings_ms} for t, o in zip(task, outs)],
                "finish_reason": "stop" if all(o.finish_reason == "stop" for o in outs) else "length",
                "timings_ms": {k: max(o.timings_ms.get(k, 0.0) for o in outs) for k in outs[0].timings_ms}}

    def locate_image(self, rgb: np.ndarray, what: str, task: str = "detect") -> dict:
        """Boxes (detect) or centres (point) of `what` in the image through the engine's model's
        region head (engine/region_decoder.py, one image at a time beside the engine's batches): as
        fractions and in pixels, with the picture they are drawn on. The tiny model's head was
        never trained: a RequestError says so."""
        from pipelines.locator import draw, pixel_places

        found = self._locator(what, task)(rgb)
        key = "objects" if task == "detect" else "points"
        h, w = rgb.shape[:2]
        pixels = pixel_places(found[key], w, h, task)
        return {task: what.strip(), key: found[key], "pixels": pixels, "width": w, "height": h,
                "timings_ms": found["timings_ms"], "picture": draw(rgb, pixels, task)}

    def _region_decoder(self):
        """The engine's model's region decoder, and the lock under which every page and feed takes
        its turn with it (a live feed's frames, an image's, a video job's batches). A model whose
        head was not trained: a RequestError now, before anything starts."""
        from engine.region_decoder import RegionDecoder

        engine = self.engine()
        with self._lock:
            if self._region is None or self._region[0] is not engine:  # one per engine: a reload drops it
                self._region = (engine, RegionDecoder(engine.loaded), threading.Lock())
            return self._region[1:]

    def _locator(self, what: str, task: str) -> Callable[[np.ndarray], dict]:
        """rgb -> the places of `what` through the engine's model's region head."""
        decoder, lock = self._region_decoder()

        def locate(rgb: np.ndarray) -> dict:
            with lock:
                return decoder.locate(rgb, what, task)

        return locate

    @staticmethod
    def _region_task(task: dict | list[dict]) -> tuple[str, str] | None:
        """("detect" or "point", OBJECT) for a region task, else None."""
        from pipelines.feed import REGION_TASKS

        region = next((k for k in REGION_TASKS if k in task), None) if isinstance(task, dict) else None
        return (region, task[region]) if region else None

    def _region_of(self, task: dict | list[dict]) -> Callable[[np.ndarray], dict] | None:
        """A live feed's task's locate function ({"detect": OBJECT} or {"point": OBJECT}), else None."""
        region = self._region_task(task)
        return self._locator(region[1], region[0]) if region else None

    def caption_video(self, path: str, task: dict | list[dict], out_dir: Path, every_n: int = 1,
                      on_progress: Callable[[int, int | None], None] | None = None,
                      stop: threading.Event | None = None, changes: bool = False) -> dict:
        """Caption a file into out_dir: captions.jsonl/.srt/.vtt and annotated.mp4; returns rows and paths
        (a region task: places.jsonl, .srt, .vtt and annotated.mp4 with the places drawn,
        `run_locate_job`).
        Setting `stop` ends the job at its next frame with what is done ("cancelled": True). With
        `changes`, the rows and the JSONL hold only the answers that changed (`video --changes`)."""
        try:
            if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
                raise UIError("no video given")
            if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
                raise UIError(f"every n-th frame must be a whole number >= 1, got {every_n!r}")
            with self.jobs.writing(out_dir):  # till the job is over: then its folder may go
                return self._caption_video(path, task, out_dir, every_n, on_progress, stop, changes)
        finally:  # a later Cancel has nothing of it to stop
            self.jobs.forget(stop)

    def _caption_video(self, path: str, task: dict | list[dict], out_dir: Path, every_n: int,
                       on_progress: Callable[[int, int | None], None] | None, stop: threading.Event | None,
                       changes: bool) -> dict:
        from app.video_job import run_locate_job, run_video_job

        region = self._region_task(task)
        if region is not None:  # {"detect": OBJECT} or {"point": OBJECT}: LOCATE_BATCH frames a turn
            kind, what = region
            decoder, lock = self._region_decoder()
            done = [0]

            def locate_many(rgbs: list[np.ndarray]) -> list[dict]:
                with self._lock:  # as a caption job stops: it had run on, keeping the old model
                    reloaded = self._region is None or self._region[1] is not decoder
                if reloaded:
                    raise UIError(f"the engine was reloaded (Settings) after {done[0]} frames: run the job again")
                with lock:
                    found = decoder.locate_batch(rgbs, what, kind)
                done[0] += len(rgbs)
                return found

            return run_locate_job(locate_many, path, kind, what, out_dir, every_n, on_progress, stop, changes,
                                  self.reading)
        return run_video_job(self.engine(), self.params(), path, task, out_dir, every_n, on_progress, stop,
                             changes, self.reading)

    def remove_outputs(self) -> None:
        """Delete every video job's outputs and every recording (the server is stopping)."""
        with self._lock:
            for recorder in self._recorders.values():
                recorder.close()
            self._recorders.clear()
        self.jobs.remove()

    def close(self) -> None:
        """Stop every feed and close the engine (a later call to `engine()` opens a new one)."""
        with self._lock:
            for key in list(self._feeds):  # each page says why it stopped, and keeps its captions to export
                feed = self._feeds.pop(key)
                feed.error = feed.error or "stopped: the engine was reloaded (Settings); Start again"
                feed.close()
                self._ended[key] = feed  # its session let go of the engine when it closed
            for recorder in self._recorders.values():  # finished files stay for their downloads
                recorder.close()
            if self._engine is not None:
                self._engine.close(cancel=True)
                self._engine = None
            self._region = None
            self._history.clear()
