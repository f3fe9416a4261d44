"""The files of one `vlmstream video` run, captioned on one engine: `VideoRun`.

Up to CONCURRENT_FILES files (more, short ones at a low --fps: `files_side_by_side`) run side by
side, each in a worker thread of its own and with its own outputs (a JSONL, subtitles, an
annotated MP4, as its `Outputs` plan says) besides the one JSONL all of them share (-o OUT.jsonl,
-o -). A file's failure is its summary's (an error, counted as incomplete), never the others'.
Ctrl-C (or SIGTERM) sets the stop flag: every worker ends at its next frame and its summary still
counts what was written; a second Ctrl-C later than DOUBLE_SIGNAL_S after the first leaves at once
(`hurry`: the frames under way are cancelled, not waited for). A reader of -o - that has had
enough stops the run quietly (`pipe_closed`); an output that cannot be written fails its file
(`write_failed`).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import TYPE_CHECKING

from app.launcher import stop_requested
from app.outputs import Rebuilds
from app.video_args import VideoArgs
from app.video_progress import FileProgress, on_terminal, tick
from pipelines.prompts import constrained

if TYPE_CHECKING:
    from pipelines.batch import BatchSummary

CONCURRENT_FILES = 4  # files captioned side by side, sharing the engine
# With sticky answers at a low --fps a file keeps few frames in flight (--fps 1: a group of one
# frame, asked while the next is staged), and the first frame of each file is asked without a
# draft, a token a step: four short clips side by side left the engine's batches a quarter full
# (100 clips of 2 s at --fps 1: 6 tokens a step against 30 for four long files). More files then
# run side by side, as many as keep the frames in flight of four files at 30 fps (32 groups'
# worth), at most MAX_FILES_SIDE_BY_SIDE, and only where the files are short (SHORT_FILE_FRAMES
# on average, as announced): each holds a decoder (16 720p files: 990 MB against 610 for four, no
# faster on files of 15 s).
MAX_FILES_SIDE_BY_SIDE = 16
SHORT_FILE_FRAMES = 300
DOUBLE_SIGNAL_S = 1.0  # a second interrupt this soon after the first is the same one
# After a Ctrl-C, the frames under way finish first (Moondream 2 on a CPU: a step of 5-30 s): a
# wait longer than this is said, else the run looked hung and a second Ctrl-C lost them.
STOP_NOTICE_S = 2.0


def files_side_by_side(sampling, params, counts: list[int | None]) -> int:
    """How many files run side by side: CONCURRENT_FILES, more where they are short (`counts`: the
    frames each announces) and each holds fewer frames in flight whatever its frame rate (sticky
    answers at a low --fps)."""
    from pipelines.batch import Sampling, sticky_group

    known = [n for n in counts if n]
    if not params.sticky or not sampling.fps or not known or sum(known) > SHORT_FILE_FRAMES * len(known):
        return CONCURRENT_FILES  # every frame, every Nth: the file's own rate says how many
    usual = CONCURRENT_FILES * sticky_group(Sampling(), 30.0, 32)  # every frame of four 30 fps files
    most = sticky_group(sampling, None, 32)  # frames a file of any rate asks together at this --fps
    return max(CONCURRENT_FILES, min(MAX_FILES_SIDE_BY_SIDE, usual // most))


class VideoRun:
    """What the files of a run share: the engine, the shared JSONL, the flags, the progress bars."""

    def __init__(self, args: argparse.Namespace, checked: VideoArgs, params, sampling, reading,
                 done: dict, resumed: dict) -> None:
        from tqdm import tqdm

        from pipelines.sources import shown_names

        self.args, self.checked = args, checked
        self.params, self.sampling, self.reading = params, sampling, reading
        self.done, self.resumed = done, resumed
        self.engine = None
        self.shared = None  # the one JSONL of every file: opened (afresh, without --resume) once the model is up
        self.stop, self.write_failed, self.pipe_closed = threading.Event(), threading.Event(), threading.Event()
        self.interrupted = False
        self.print_lock = threading.Lock()
        # Up to CONCURRENT_FILES run side by side, each with a bar of its own; more files than that
        # share one bar over all their frames, so a folder of hundreds does not print hundreds of bars.
        self.overall = None
        paths = checked.paths
        self.counts = {p: n for p, n, _ in paths}  # the frames each file announces (None: it does not say)
        self.names = shown_names([p for p, _, _ in paths])  # on the terminal
        if len(paths) > CONCURRENT_FILES:
            # A file that announces no frame count (a raw .h264 camera export) adds its frames as they
            # are read, and each file's count is set right at its end: one such file had taken the
            # total, and with it the ETA, off a whole folder's bar.
            self.overall = tqdm(total=sum(n for n in self.counts.values() if n) or None, desc=f"{len(paths)} files",
                                unit="frame", file=sys.stderr)
            self.overall.set_postfix(files_done=0)
        self.files_done = 0
        self.bars: list = []  # the bars open now, redrawn by `tick` while they stand still
        self.trackers: list = []  # with --changes: every AnswerChanges, for the count of changes

    def jsonl_sink(self, sink):
        """The sink itself, or with --changes the filter that passes it only the answers that changed."""
        from pipelines.changes import ChangedAnswersSink

        if not self.args.changes:
            return sink
        filtered = ChangedAnswersSink(sink, self.args.hold or 1, self.checked.snapshots, constrained(self.checked.tasks))
        self.trackers.append(filtered.changes)
        return filtered

    def open_shared(self) -> None:
        """The JSONL every file writes to (-o OUT.jsonl, -o -), if there is one."""
        from pipelines.sinks import JsonlSink

        c = self.checked
        self.shared = (self.jsonl_sink(JsonlSink(sys.stdout if c.to_stdout else c.out, append=self.args.resume))
                       if c.kind == "jsonl" else None)

    def caption(self, engine) -> list[BatchSummary]:
        """Every file's BatchSummary (those of files stopped before their turn too); `interrupted`
        says whether Ctrl-C (or SIGTERM) stopped them. A second Ctrl-C in a hurry raises."""
        from concurrent.futures import ThreadPoolExecutor

        self.engine = engine
        paths, summaries = self.checked.paths, []
        notice = threading.Timer(STOP_NOTICE_S, _say_stopping)
        notice.daemon = True
        side_by_side = files_side_by_side(self.sampling, self.params, list(self.counts.values()))
        ticked = threading.Event()
        if self.overall is not None:
            self.bars.append(self.overall)
        if on_terminal():
            threading.Thread(target=tick, args=(self.bars, self.print_lock, ticked), name="vlmstream-bars",
                             daemon=True).start()
        with ThreadPoolExecutor(max_workers=min(side_by_side, len(paths))) as pool:
            futures = [pool.submit(self.process, i, path) for i, (path, _, _) in enumerate(paths)]
            all_done = _AllDone(futures)
            try:
                # Poll: a SIGINT the kernel hands to a worker thread is only noticed by the main
                # thread when it next wakes, so it must never block without a timeout. On one event,
                # not wait(futures): that put a waiter on every file's future 10 times a second
                # (10,000 files: 14 ms a poll, a seventh of a core, under the futures' locks).
                while not all_done.wait(timeout=0.1):
                    if stop_requested():  # a SIGTERM whose KeyboardInterrupt was lost (in a finalizer)
                        raise KeyboardInterrupt
                summaries += [f.result() for f in futures]
            except KeyboardInterrupt:  # Ctrl-C: the workers stop at their next frame
                self.interrupted, first = True, time.perf_counter()
                self.stop.set()
                notice.start()
                while True:
                    try:
                        summaries += [f.result() for f in futures if not f.cancelled()]
                        break
                    except KeyboardInterrupt:
                        # The same stop twice (GNU timeout signals the command and its group): the
                        # summary was lost to it. A second Ctrl-C later than that is a hurry: it goes.
                        if time.perf_counter() - first > DOUBLE_SIGNAL_S:
                            self.hurry()
                            raise
            finally:
                # However the wait ended: a second SIGINT that came before the handler's stop.set()
                # escaped it, and the pool's exit then waited for workers never told to stop (every
                # file captioned to its end, then exit 130 without a summary).
                self.stop.set()
                notice.cancel()
                ticked.set()
        return summaries

    def hurry(self) -> None:
        """A second Ctrl-C: the frames under way are cancelled, not finished. The pool's exit
        waits for its workers, and they waited on those answers: Moondream 2 on a CPU left 26 s
        after "Ctrl-C again to quit now". Cancelled, each worker's wait ends at the engine's next
        step and its outputs close whole (the answers written stay; the cancelled ones are not
        written)."""
        self.stop.set()
        if self.engine is not None:
            self.engine.close(cancel=True)

    def close(self) -> None:
        if self.overall is not None:
            self.overall.close()
        if self.shared:
            self.shared.close()

    def process(self, i: int, path: str) -> BatchSummary:
        """One file captioned (the i-th: its bar's line) into its outputs; its BatchSummary."""
        from pipelines.annotated import AnnotatedVideoSink
        from pipelines.batch import BatchSummary, caption_file
        from pipelines.sinks import JsonlSink, SubtitleSink, source_key
        from pipelines.sources import FileSource, SourceError

        args, summary, plan = self.args, BatchSummary(), self.checked.plans[path]
        if self.stop.is_set():  # interrupted before this file's turn
            return summary
        try:
            src = FileSource(path, reading=self.reading)  # probed already; opened only now: a folder may hold thousands
        except SourceError as e:  # changed since it was probed
            summary.errors.append(str(e))
            summary.incomplete += 1
            return summary
        shared = self.shared
        sinks: list = [shared] if shared else []
        progress = FileProgress(self, i, path, src.frame_count, summary)
        rebuilt = Rebuilds(args.resume)  # replaced once the new ones hold as far as the old
        finished, broken, had_last = False, False, -1

        try:
            file_done = self.done
            # Its first frame before any output of its own: a file with none (cut off after its
            # header) is said, and left empty outputs behind that looked like a run without answers.
            first = next(src.frames(lazy=True), None)
            if first is not None and plan.annotate:  # its pixels converted only for --annotate's size
                first.load()
            src.close()
            if first is None:
                summary.files += 1
                summary.errors.append(src.error or f"{path}: no frame could be decoded")
                summary.incomplete += 1
                return summary
            src = FileSource(path, reading=self.reading)
            here = source_key(src.source_id)
            if plan.jsonl:
                plan.jsonl.parent.mkdir(parents=True, exist_ok=True)
                # The file's own JSONL: its answers are this video's, whatever path they name (one
                # relative to where the first run ran, resumed from elsewhere, was asked again).
                file_done = {(here, *k[1:]): r for k, r in self.resumed.pop(path, {}).items()}
                sinks.append(self.jsonl_sink(JsonlSink(plan.jsonl, append=args.resume)))
            had_last = max((k[1] for k in file_done if k[0] == here), default=-1)  # the outputs' last frame
            for sub_path, fmt in plan.subtitles:
                sub_path.parent.mkdir(parents=True, exist_ok=True)
                sinks.append(SubtitleSink(rebuilt.path(sub_path), fmt, self.sampling.period(src.fps)))
            if plan.annotate:
                plan.annotate.parent.mkdir(parents=True, exist_ok=True)
                sinks.append(AnnotatedVideoSink(rebuilt.path(plan.annotate), first.rgb.shape[1], first.rgb.shape[0],
                                                frame_duration=self.sampling.period(src.fps)))
            caption_file(self.engine, src, sinks, self.checked.tasks, self.params, self.sampling, file_done,
                         on_frame=progress.show, summary=summary, stop=self.stop)
            finished = True
        except KeyboardInterrupt:  # stopped by the flag: the summary still counts what was written
            self.stop.set()
        except BrokenPipeError:  # -o - piped into a reader that has had enough (`head`): stop quietly
            self.pipe_closed.set()
            self.stop.set()
        except OSError as e:  # an output cannot be written (disk full, permissions): this file fails
            self.write_failed.set()
            broken = True
            where = e.filename or ("standard output" if self.checked.to_stdout else "its results")
            summary.errors.append(f"{path}: cannot write {where}: {e.strerror or e}")  # not "[Errno 28] ..."
        finally:
            progress.finish()
            for sink in sinks:
                if sink is not shared:
                    try:
                        sink.close(src.end)
                    except OSError as e:  # named: the others (on another disk, say) are whole
                        self.write_failed.set()
                        broken = True
                        said = f"{path}: cannot write {getattr(sink, 'path', None) or 'its results'}: {e.strerror or e}"
                        if said not in summary.errors:
                            summary.errors.append(said)
            # Stopped past the last frame they had: the rebuilt outputs go as far, and further.
            try:
                rebuilt.finish(not broken and (finished or progress.written_last >= had_last))
            except OSError as e:
                self.write_failed.set()
                summary.errors.append(f"{path}: cannot put its rebuilt outputs in place: {e.strerror or e}")
            src.close()
        return summary


class _AllDone(threading.Event):
    """Set once every one of the futures is done (finished, failed or cancelled)."""

    def __init__(self, futures: list) -> None:
        super().__init__()
        self._left, self._lock = len(futures), threading.Lock()
        if not futures:
            self.set()
        for f in futures:
            f.add_done_callback(self._one_done)

    def _one_done(self, _future) -> None:
        with self._lock:
            self._left -= 1
            if not self._left:
                self.set()


def _say_stopping() -> None:
    from tqdm import tqdm

    try:  # between the progress bars' redraws; a closed stderr (2>&-) is given up, as elsewhere
        tqdm.write("vlmstream: stopping: the frames under way finish first (Ctrl-C again to quit now)",
                   file=sys.stderr)
    except (OSError, ValueError):
        pass
