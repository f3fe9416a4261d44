"""Offline captioning of video files: every frame, N per second, or every Nth frame.

Frames are submitted to the engine with a bounded number in flight (back-pressure: decoding
never runs ahead of the engine by more than `max_inflight` frames) and their results are written
in frame order, never dropped. Several files can run at once, each in its own thread, sharing
one engine (which then batches their frames together); several prompts about each frame share
its image prefix. With `done` (a previous run's JSONL, read by `done_frames`), answers already
given are not asked again: they go, in frame order, to the sinks that do not hold them already
(subtitles and an annotated MP4 are rebuilt whole; the JSONL only gets the new answers), and
the frames up to the last of them are not decoded again where the file can seek (resume.py). A
`stop` event ends a run early (Ctrl-C): its frames still in flight are cancelled, what was
written stays.

Sticky answers (`params.sticky` > 0): frames are asked in groups (`sticky_group()`), every
frame of a group drafting from the answers of the group before's last frame, as a live
session's frames between two results share the latest answer (from a scene cut on, a group's
frames are asked afresh); the next group's images are encoded while a group decodes. The
answers depend only on the file and the settings, never on timing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from engine.errors import EngineClosedError
from engine.types import SamplingParams

if TYPE_CHECKING:  # not at run time: the command line checks its arguments before torch loads
    from engine import Engine

from .cuts import CutDetector
from .prompts import ask, prompt_key, prompt_of, tasks_of
from .resume import answered, resumed_frames
from .sampling import Sampling
from .sinks import FrameResult, source_key
from .frame import Frame
from .sources import FileSource

# Video time per group of frames with sticky answers (8 frames at 30 fps): long enough to keep
# the engine batching, short enough that a draft still holds the scene. On the 30 fps samples, 8
# gave fewer changes than 15 and ran faster than 4 (EVAL.md, sticky answers in `video`).
STICKY_GROUP_S = 0.25


@dataclass
class BatchSummary:
    files: int = 0
    frames_decoded: int = 0
    frames_captioned: int = 0
    frames_skipped: int = 0
    errors: list[str] = field(default_factory=list)
    incomplete: int = 0  # files not read to their end (or not at all): their error says why
    seconds: float = 0.0
    video_seconds: float = 0.0


def caption_file(engine: Engine, source: FileSource, sinks: list, task: dict | list[dict], params: SamplingParams,
                 sampling: Sampling, done: Mapping[tuple, FrameResult] | None = None,
                 max_inflight: int = 32,
                 on_frame: Callable[[FrameResult], None] | None = None,
                 summary: BatchSummary | None = None, stop: threading.Event | None = None) -> BatchSummary:
    """task: one prompt ({"caption": "short"} or {"question": "..."}) or several, all asked about
    every processed frame (on one shared image prefix). Sinks get each frame's answers together,
    in prompt order; `on_frame` gets every answer."""
    tasks = tasks_of(task)
    return _FileRun(engine, source, sinks, tasks, params, sampling, done, max_inflight, on_frame,
                    summary or BatchSummary(), stop).run()


class _FileRun:
    """One file of `caption_file`: its frames in flight, answered in frame order (`pending`),
    and with sticky answers the group being staged while the group before decodes."""

    def __init__(self, engine: Engine, source: FileSource, sinks: list, tasks: list[dict], params: SamplingParams,
                 sampling: Sampling, done: Mapping[tuple, FrameResult] | None, max_inflight: int,
                 on_frame: Callable[[FrameResult], None] | None, summary: BatchSummary,
                 stop: threading.Event | None):
        self.engine, self.source, self.sinks, self.tasks, self.params = engine, source, sinks, tasks, params
        self.sampling, self.done, self.on_frame, self.summary, self.stop = sampling, done, on_frame, summary, stop
        self.last: list[list[int] | None] | None = None  # with sticky answers: the latest finished frame's, per prompt
        if params.sticky:
            max_inflight = sticky_group(sampling, source.fps, max_inflight)
            self.last = [None] * len(tasks)
        self.max_inflight = max_inflight
        self.pending: deque[tuple[Frame, list]] = deque()  # per frame: a FrameResult (recorded) or a handle per task
        self.t0 = time.perf_counter()
        self.staged: list[tuple[Frame, list, object, bool | None]] = []  # sticky: the next group, its images encoding
        self.model: str | None = None  # in each line: --resume checks it
        self.cuts = CutDetector() if self.last is not None else None
        # Sticky answers look for scene cuts in every frame, recorded or not, as a full run does: as
        # frames are staged, while the group before decodes. A resumed run reads a recorded frame's
        # pixels only where they decide a cut in a group that asks new frames (`find_cuts`, before it
        # asks): converting every replayed frame to RGB for its thumbnail made a resume of 60,000 done
        # frames wait 100 s for its first new answer.
        self.replay = self.cuts is not None and bool(done)
        self.last_staged: Frame | None = None
        self.last_read: Frame | None = None  # the frame whose thumbnail `cuts` compares the next one with
        self.group_before: Frame | None = None  # the last frame of the group before
        self.first_new: float | None = None  # the time of the first frame answered now (not replayed)

    def finish_one(self) -> None:
        frame, items = self.pending.popleft()
        results, new = [], []
        for t, item in zip(self.tasks, items):
            if not isinstance(item, FrameResult):  # asked now (else recorded by an earlier run)
                out = item.wait()  # as long as the engine makes progress (a slow model's frames)
                if out.finish_reason not in ("stop", "length"):  # the engine was closed or failed under it
                    # Not written: a cut-off answer passed for the frame's, and --resume counted it done.
                    raise EngineClosedError(f"{self.source.name}: frame {frame.index} was {out.finish_reason} "
                                            "(the engine was closed or failed)")
                item = FrameResult(frame.source_id, frame.index, round(frame.pts, 6), out.text, out.token_ids,
                                   out.finish_reason, out.timings_ms, prompt_of(t), self.model)
                new.append(item)
            results.append(item)
        for sink in self.sinks:
            if not getattr(sink, "holds_done", False):
                sink.write_frame(results, frame.rgb)
            elif new:
                sink.write_frame(new, frame.rgb)
        self.summary.frames_captioned += bool(new)
        if new and self.first_new is None:
            self.first_new = frame.pts
        self.summary.frames_skipped += not new
        if self.last is not None:
            self.last[:] = [r.token_ids for r in results]
        if self.on_frame:
            for r in results:
                self.on_frame(r)

    def submit(self, frame: Frame, items: list, image, fresh: bool = False) -> None:
        missing = [i for i, item in enumerate(items) if item is None]
        if missing:  # several prompts share one image encoding
            drafts = [self.last[i] for i in missing] if self.last is not None and not fresh else None
            for i, handle in zip(missing, ask(self.engine, image, [self.tasks[i] for i in missing], self.params,
                                              drafts)):
                items[i] = handle
        self.pending.append((frame, items))  # recorded answers queue too, so every sink sees frame order

    def cut_of(self, frame: Frame, before: Frame | None) -> bool:
        """Whether a scene cut comes at `frame`, against `before`, the frame picked before it."""
        if before is not None and self.last_read is not before:  # the one to compare with, first
            self.cuts.is_cut(before.load().rgb)
        self.last_read = frame
        return self.cuts.is_cut(frame.load().rgb)

    def stage_cut(self, frame: Frame) -> bool | None:
        """The cut at a frame as it is staged, or None to find later (a replayed frame not converted)."""
        before, self.last_staged = self.last_staged, frame
        return None if frame.rgb is None else self.cut_of(frame, before)

    def find_cuts(self) -> None:
        staged = self.staged
        if not any(ref is not None for _, _, ref, _ in staged):  # recorded answers only: it asks nothing
            return
        for i, (frame, items, ref, cut) in enumerate(staged):  # a group that asks: as a full run finds them
            if cut is None:
                staged[i] = (frame, items, ref, self.cut_of(frame, staged[i - 1][0] if i else self.group_before))

    def next_group(self) -> None:
        while self.pending:  # the group before: its last answers are this group's drafts
            self.finish_one()
        if self.stop is not None and self.stop.is_set():  # Ctrl-C while they finished: ask no more
            # (the next group was asked, then the file decoded on to the group after it, only to
            # cancel it: Moondream 2 at --fps 0.2 showed 94 % done after 2 of 4 frames)
            raise KeyboardInterrupt
        try:
            if self.replay:
                self.find_cuts()
                self.group_before = self.staged[-1][0]
            fresh = False  # from a scene cut on, the group's frames are asked without a draft
            for frame, items, ref, cut in self.staged:
                fresh |= bool(cut)  # None: a group of recorded answers only, which asks nothing
                self.submit(frame, items, ref, fresh)
        finally:
            for _, _, ref, _ in self.staged:
                if ref is not None:
                    ref.release()
            self.staged.clear()

    def run(self) -> BatchSummary:
        source, summary, done, tasks, stop = self.source, self.summary, self.done, self.tasks, self.stop
        pending, staged = self.pending, self.staged
        decoded_before = summary.frames_decoded  # a summary may span several files
        try:
            pixels_wanted = not done or any(getattr(sink, "needs_rgb", False) for sink in self.sinks)

            key = source_key(source.source_id)  # as done_frames keys its answers
            from engine.models.loader import model_id

            loaded = getattr(self.engine, "loaded", None)
            self.model = model_id(loaded.name) if loaded is not None else None

            def need_rgb(index: int) -> bool:  # a frame whose every answer is recorded is only replayed
                return pixels_wanted or any((key, index, prompt_key(t)) not in done for t in tasks)

            picked: set[int] = set()
            # Resumed: the frames whose answers are all recorded are replayed from them, undecoded, up
            # to the one decoding starts at. Replayed: every frame comes unconverted, and those with a
            # new answer to ask are converted now
            recorded = {} if pixels_wanted else answered(done, key, tasks)
            group = self.max_inflight if self.last is not None else None
            for frame in resumed_frames(source, self.sampling, recorded, group,
                                        need_rgb=None if self.replay else need_rgb, lazy=self.replay):
                if self.replay and need_rgb(frame.index):
                    frame.load()
                picked.add(frame.index)
                summary.frames_decoded = decoded_before + source.decoded
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt
                items = [done.get((key, frame.index, prompt_key(t))) if done else None for t in tasks]
                if self.last is None:
                    self.submit(frame, items, frame.rgb)
                    if len(pending) >= self.max_inflight:
                        self.finish_one()
                    continue
                # Sticky: frames are asked a group at a time, drafting from the group before's last
                # answers; a group's images are encoded while the group before decodes.
                new = any(item is None for item in items)
                staged.append((frame, items, self.engine.encode_image(frame.rgb) if new else None,
                               self.stage_cut(frame)))
                if len(staged) >= self.max_inflight:
                    self.next_group()
            if staged:
                self.next_group()
            while pending:
                self.finish_one()
            # A JSONL written with another --fps or --every-n: its other frames stay in it, where a
            # full run would not have them (and sticky answers drafted from other frames than here).
            others = {index for k, index, _ in (done or {}) if k == key and index not in picked}
            if others:
                summary.errors.append(f"{source.name}: the JSONL also holds answers for {len(others)} frames this "
                                      "run does not pick (written with another --fps or --every-n?)")
        except BaseException:
            for _, _, ref, _ in staged:
                if ref is not None:
                    ref.release()
            for _, items in pending:  # interrupted: do not leave work behind in the engine
                for item in items:
                    if item is not None and not isinstance(item, FrameResult):
                        item.cancel()
            raise
        finally:
            summary.frames_decoded = decoded_before + source.decoded
            summary.seconds += time.perf_counter() - self.t0
            # Resumed, the video this run answered: from its first new frame on. Counted from the
            # file's start, a run that answered the last 6 s of 16 in 47 s (Moondream 2 on a CPU)
            # said 0.34x real time, and a 2-hour file resumed near its end would say 100x.
            replayed = self.first_new if done and self.first_new is not None else 0.0
            summary.video_seconds += max(0.0, source.seconds - replayed)
            summary.files += 1
            if source.error:
                summary.errors.append(source.error)
            summary.incomplete += source.incomplete
        return summary


def sticky_group(sampling: Sampling, video_fps: float | None, max_inflight: int) -> int:
    """Frames asked together with sticky answers: about STICKY_GROUP_S of video, at most `max_inflight`."""
    rate = sampling.fps or (video_fps or 30.0) / (sampling.every_n or 1)
    if sampling.fps and video_fps:
        rate = min(rate, video_fps)
    return max(1, min(max_inflight, round(STICKY_GROUP_S * rate)))


def merge(summaries: list[BatchSummary]) -> BatchSummary:
    total = BatchSummary()
    for s in summaries:
        total.files += s.files
        total.frames_decoded += s.frames_decoded
        total.frames_captioned += s.frames_captioned
        total.frames_skipped += s.frames_skipped
        total.errors += s.errors
        total.incomplete += s.incomplete
        total.seconds = max(total.seconds, s.seconds)  # files ran side by side
        total.video_seconds += s.video_seconds
    return total
