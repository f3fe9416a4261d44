"""Offline captioning of video files: every frame, N per second, or every Nth frame.

Frames are submitted to the engine with a bounded number in flight (back-pressure: decoding
never runs ahead of the engine by more than `max_inflight` frames) and their results are written
in frame order, never dropped. Several files can run at once, each in its own thread, sharing
one engine (which then batches their frames together). With `done` (a previous run's JSONL, read
by `done_frames`), frames already captioned are not captioned again: their recorded results go,
in frame order, to the sinks that do not hold them already (subtitles and an annotated MP4 are
rebuilt whole; the JSONL only gets the new frames). A `stop` event ends a run early (Ctrl-C): its
frames still in flight are cancelled, what was written stays.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

from engine import Engine, SamplingParams

from .sinks import FrameResult
from .sources import FileSource, Frame


@dataclass(frozen=True)
class Sampling:
    """Which frames to process: every frame, `fps` per second of video time, or every Nth."""

    fps: float | None = None
    every_n: int | None = None

    def select(self, frames: Iterable[Frame]) -> Iterator[Frame]:
        pick = self.picker()
        return (f for f in frames if pick(f.index, f.pts))

    def picker(self) -> Callable[[int, float], bool]:
        """A fresh predicate over (index, pts) in decode order: whether that frame is processed.
        A source asks it before converting a frame to RGB, the larger part of reading one."""
        if self.every_n:
            return lambda index, pts: index % self.every_n == 0
        if not self.fps:
            return lambda index, pts: True
        step, next_t = 1.0 / self.fps, None

        def pick(index: int, pts: float) -> bool:
            nonlocal next_t
            if next_t is not None and pts < next_t - 1e-9:
                return False
            next_t = (pts if next_t is None else next_t) + step
            while next_t <= pts:
                next_t += step
            return True

        return pick


@dataclass
class BatchSummary:
    files: int = 0
    frames_decoded: int = 0
    frames_captioned: int = 0
    frames_skipped: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    video_seconds: float = 0.0


def caption_file(engine: Engine, source: FileSource, sinks: list, task: dict, params: SamplingParams,
                 sampling: Sampling, done: Mapping[tuple[str, int], FrameResult] | None = None,
                 max_inflight: int = 32,
                 on_frame: Callable[[FrameResult], None] | None = None,
                 summary: BatchSummary | None = None, stop: threading.Event | None = None) -> BatchSummary:
    summary = summary or BatchSummary()
    pending: deque[tuple[Frame, object]] = deque()
    t0 = time.perf_counter()

    def finish_one() -> None:
        frame, handle = pending.popleft()
        if isinstance(handle, FrameResult):  # recorded by an earlier run
            r = handle
            for sink in sinks:
                if not getattr(sink, "holds_done", False):
                    sink.write(r, frame.rgb)
        else:
            out = handle.result(timeout=600)
            r = FrameResult(frame.source_id, frame.index, round(frame.pts, 6), out.text, out.token_ids,
                            out.finish_reason, out.timings_ms)
            for sink in sinks:
                sink.write(r, frame.rgb)
            summary.frames_captioned += 1
        if on_frame:
            on_frame(r)

    last_pts = 0.0
    decoded_before = summary.frames_decoded  # a summary may span several files
    try:
        for frame in source.frames(pick=sampling.picker()):
            summary.frames_decoded = decoded_before + source.decoded
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            last_pts = frame.pts
            recorded = done.get((frame.source_id, frame.index)) if done else None
            if recorded is not None:
                summary.frames_skipped += 1
                pending.append((frame, recorded))  # queued, so every sink still sees frame order
            else:
                pending.append((frame, engine.submit(frame.rgb, params=params, **task)))
            if len(pending) >= max_inflight:
                finish_one()
        while pending:
            finish_one()
    except BaseException:
        for _, handle in pending:  # interrupted: do not leave work behind in the engine
            if not isinstance(handle, FrameResult):
                handle.cancel()
        raise
    finally:
        summary.frames_decoded = decoded_before + source.decoded
        summary.seconds += time.perf_counter() - t0
        summary.video_seconds += last_pts
        summary.files += 1
        if source.error:
            summary.errors.append(source.error)
    return summary


def merge(summaries: list[BatchSummary]) -> BatchSummary:
    total = BatchSummary()
    for s in summaries:
        total.files += s.files
        total.frames_decoded += s.frames_decoded
        total.frames_captioned += s.frames_captioned
        total.frames_skipped += s.frames_skipped
        total.errors += s.errors
        total.seconds = max(total.seconds, s.seconds)  # files ran side by side
        total.video_seconds += s.video_seconds
    return total
