"""What the web UI serves, without the web: one engine per process, shared by every browser tab.

The engine is created on first use (importing this module loads nothing heavy) and rebuilt when
the model or device setting changes. Each browser tab is a session id; a session owns at most one
pulled live feed (a file, stream or webcam on the server) and one pushed feed (its browser's
camera); closing the tab closes both and cancels their requests (`app.live_sessions`, on this
engine and under this service's lock). Single images and video files go through the same engine
via the pipelines' public functions. Every user mistake raises `UIError` (or a `VlmstreamError`)
with a one-line message for the page.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np

from app.errors import UIError
from app.inflight_share import MAX_FEEDS
from app.live_sessions import RECORD_MAX_S, LiveSessions
from app.samples import SAMPLES_DIR, sample_videos, samples_dir
from app.settings import Settings, checked
from app.source_list import SourceList
from app.video_jobs import VideoJobs
from pipelines.frame import AS_SHOWN, Reading

# The web UI's back end in one import (the tests and scripts take these from here), some of the
# names from the modules that hold them
__all__ = ["RATE_WINDOW_S", "RECORD_MAX_S", "SAMPLES_DIR", "Service", "Settings", "UIError", "sample_videos",
           "samples_dir"]

RATE_WINDOW_S = 3.0  # engine tokens/s and busy % shown in the UI are over about this long


class Service:
    def __init__(self, settings: Settings = Settings(), reading: Reading = AS_SHOWN, max_feeds: int = MAX_FEEDS,
                 sources: SourceList = SourceList()):
        """reading: how every source of this server is read (`pipelines.frame.Reading`; default
        as a player shows it); fixed for the server (`ui --no-deinterlace / --no-tonemap`).
        max_feeds: live feeds played at once, beyond which a Start is refused (`ui --max-feeds`).
        sources: the named sources a page chooses from, and whether it may play others (`ui --sources`)."""
        self.settings = settings
        self.reading = reading
        self.sources = sources
        self._lock = threading.RLock()
        self._engine = None
        self._history: deque = deque(maxlen=4096)  # engine stats snapshots behind the current rates
        self.jobs = VideoJobs()  # video jobs' turns and stop flags; the folder of every output
        self._region: tuple | None = None  # (engine, its RegionDecoder, a lock: one call at a time)
        self.live = LiveSessions(self, self._lock, max_feeds)  # each browser tab's live feeds, recordings and exports

    # ---------------------------------------------------------------- engine and settings
    def engine(self):
        with self._lock:
            if self._engine is None:
                from engine import Engine, EngineConfig

                self._engine = Engine(EngineConfig(model=self.settings.model, device=self.settings.device,
                                                   dtype=self.settings.dtype,
                                                   pipeline_depth=2 if self.settings.pipelined else 1))
            return self._engine

    def current_engine(self):
        """The engine now, or None: unlike `engine()`, opens none (a live Start checks that the
        engine it built its feed on was not reloaded meanwhile)."""
        with self._lock:
            return self._engine

    def params(self):
        from engine import SamplingParams

        s = self.settings
        # Sticky answers are greedy ones; live feeds and video jobs bring the drafts (a single image has none).
        return SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens,
                              sticky=s.sticky if s.temperature == 0 else 0.0)

    def apply(self, settings: Settings, on_applied: Callable[[Settings, Settings], None] | None = None) -> str:
        """Change settings; a new model or device stops every feed and reloads the engine. One
        that cannot load is said before anything stops (every tab's feeds and jobs stopped for a
        mistyped model folder). on_applied(old, new): once they are, under the same lock (the
        activity log's "what changed": read apart, another page's Apply could come between)."""
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
                self.live.set_params()
            if on_applied is not None:
                on_applied(old, settings)
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

    # ---------------------------------------------------------------- live feeds (app/live_sessions.py)
    def start_live(self, session: str, source: str, task: dict, record: bool = False,
                   name: str | None = None) -> object:
        return self.live.start_live(session, source, task, record, name)

    def recording(self, session: str, kind: str = "pull") -> Path:
        return self.live.recording(session, kind)

    def feed(self, session: str, kind: str = "pull"):
        return self.live.feed(session, kind)

    def stop_live(self, session: str, kind: str = "pull", why: str = "stopped") -> None:
        self.live.stop_live(session, kind, why)

    def push_frame(self, session: str, rgb: np.ndarray, task: dict, record: bool = False) -> object:
        return self.live.push_frame(session, rgb, task, record)

    def export_log(self, session: str, kind: str = "pull") -> Path:
        return self.live.export_log(session, kind)

    def export_shots(self, session: str, kind: str = "pull") -> Path:
        return self.live.export_shots(session, kind)

    def close_session(self, session: str) -> None:
        self.live.close_session(session)

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

    def region_of(self, task: dict | list[dict]) -> Callable[[np.ndarray], dict] | None:
        """A live feed's task's locate function ({"detect": OBJECT} or {"point": OBJECT}), else None."""
        region = self._region_task(task)
        return self._locator(region[1], region[0]) if region else None

    def caption_video(self, path: str, task: dict | list[dict], out_dir: Path, every_n: int = 1,
                      on_progress: Callable[[int, int | None], None] | None = None,
                      stop: threading.Event | None = None, changes: bool = False, name: str | None = None) -> dict:
        """Caption a file into out_dir: captions.jsonl/.srt/.vtt and annotated.mp4; returns rows and paths
        (a region task: places.jsonl, .srt, .vtt and annotated.mp4 with the places drawn,
        `run_locate_job`).
        Setting `stop` ends the job at its next frame with what is done ("cancelled": True). With
        `changes`, the rows and the JSONL hold only the answers that changed (`video --changes`).
        `name`: what the JSONL's lines call the file (an upload by its own name; else its path)."""
        try:
            if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
                raise UIError("no video given")
            if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
                raise UIError(f"every n-th frame must be a whole number >= 1, got {every_n!r}")
            with self.jobs.writing(out_dir):  # till the job is over: then its folder may go
                return self._caption_video(path, task, out_dir, every_n, on_progress, stop, changes, name)
        finally:  # a later Cancel has nothing of it to stop
            self.jobs.forget(stop)

    def _caption_video(self, path: str, task: dict | list[dict], out_dir: Path, every_n: int,
                       on_progress: Callable[[int, int | None], None] | None, stop: threading.Event | None,
                       changes: bool, name: str | None = None) -> dict:
        from app.video_job import run_locate_job, run_video_job
        from engine.errors import EngineClosedError

        region = self._region_task(task)
        if region is not None:  # {"detect": OBJECT} or {"point": OBJECT}: LOCATE_BATCH frames a turn
            kind, what = region
            decoder, lock = self._region_decoder()

            def locate_many(rgbs: list[np.ndarray]) -> list[dict]:
                with self._lock:  # as a caption job stops: it had run on, keeping the old model
                    reloaded = self._region is None or self._region[1] is not decoder
                if reloaded:  # the job ends there, its frames so far handed over (app/video_job.py)
                    raise EngineClosedError("the region decoder was replaced (Settings)")
                with lock:
                    return decoder.locate_batch(rgbs, what, kind)

            return run_locate_job(locate_many, path, kind, what, out_dir, every_n, on_progress, stop, changes,
                                  self.reading, name)
        return run_video_job(self.engine(), self.params(), path, task, out_dir, every_n, on_progress, stop,
                             changes, self.reading, name)

    def remove_outputs(self) -> None:
        """Delete every video job's outputs and every recording (the server is stopping)."""
        self.live.forget_recordings()
        self.jobs.remove()

    def close(self, why: str = "the engine was reloaded") -> None:
        """Stop every feed and close the engine (a later call to `engine()` opens a new one).
        why: what the activity log says stopped the feeds."""
        with self._lock:  # one hold with the engine's close: no Start installs a feed on it in between
            self.live.stop_all(why)
            if self._engine is not None:
                self._engine.close(cancel=True)
                self._engine = None
            self._region = None
            self._history.clear()
