"""The files of one `vlmstream video --detect/--point` run (app/video_locate.py), located one after
another through the region decoder: `VideoLocateRun`.

`VideoLocateRun` holds what the files share: the decoder, the one JSONL of every file (-o
OUT.jsonl, -o -), the frames done before (--resume), --changes, and the figures of the summary
line (frames located, places found, frames replayed, the files' errors). `_FileLocate` is one
file while it is read: its outputs (its own JSONL, subtitles, an --annotate MP4), the frames
waiting for their batch, the last frame index written. A file that cannot be read, or has no
frame, is an error of the run's and the next file goes on; an output that cannot be written
(OSError), a closed pipe, Ctrl-C or SIGTERM (KeyboardInterrupt) leaves `locate_file` with every
output of the file closed whole, for app/video_locate.py to end the run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from app.cli import reading_arg
from app.outputs import Rebuilds

if TYPE_CHECKING:
    from engine.region_decoder import RegionDecoder


class VideoLocateRun:
    """What the files of a run share; `done` maps (source_key, frame index) to the line written
    before (--resume), `resumed` each video's own JSONL's (app.outputs.read_resumed). The shared
    JSONL is opened (afresh, without --resume) when it is made: once the model is up."""

    def __init__(self, args: argparse.Namespace, paths: list[tuple[str, int | None, Path]], plans: dict,
                 out: Path | None, to_stdout: bool, sampling, task: str, what: str, decoder: RegionDecoder,
                 done: dict, resumed: dict, model: str, load_ms: float) -> None:
        from pipelines.changes import AnswerChanges
        from pipelines.sinks import JsonlSink
        from pipelines.sources import shown_names

        self.args, self.paths, self.plans, self.sampling = args, paths, plans, sampling
        self.names = shown_names([p for p, _, _ in paths])  # on the terminal
        self.task, self.what, self.decoder, self.model, self.load_ms = task, what, decoder, model, load_ms
        self.done, self.resumed = done, resumed
        self.resume = bool(args.resume)
        self.key = "objects" if task == "detect" else "points"
        self.jsonl_out = out if out is not None and out.suffix.lower() == ".jsonl" else None  # not -o OUT.srt
        self.made = self.jsonl_out is not None and not self.jsonl_out.exists()  # removed again if the run gives nothing
        self.shared = (JsonlSink(sys.stdout) if to_stdout
                       else (JsonlSink(out, append=self.resume) if self.jsonl_out else None))
        self.on_terminal = out is None and not to_stdout and all(not p.jsonl and not p.subtitles
                                                                 for p in plans.values())
        self.changes = AnswerChanges(args.hold or 1) if args.changes else None  # per file: keyed by source
        self.snapshots = Path(args.snapshots) if args.snapshots else None
        self.frames = self.found_total = self.incomplete = self.replayed = 0
        self.interrupted, self.errors, self.write_error = False, [], None
        self.bar = None  # the progress bar of the file read last

    def locate_file(self, path: str, count: int | None) -> None:
        """One file (`count`: the frames it announces) located into its outputs; one that cannot be
        read, or has no frame, is an error (counted incomplete)."""
        from pipelines.sources import FileSource, SourceError

        try:
            src = FileSource(path, reading=reading_arg(self.args))
        except SourceError as e:  # changed since it was probed
            self.errors.append(str(e))
            self.incomplete += 1
            return
        # Its first frame before any output of its own: a file with none (cut off after its
        # header) left empty outputs behind that looked like a run that found nothing.
        with src:
            first = next(src.frames(lazy=True), None)
        if first is None:
            self.errors.append(src.error or f"{path}: no frame could be decoded")
            self.incomplete += 1
            return
        _FileLocate(self, path, FileSource(path, reading=reading_arg(self.args))).locate(count)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


class _FileLocate:
    """One file's outputs while it is located: its lines (its own JSONL, else the run's shared
    one), its subtitles, its --annotate MP4 (made at the first frame drawn); the frames waiting
    for their batch; the last frame index written."""

    def __init__(self, run: VideoLocateRun, path: str, src) -> None:
        from pipelines.sinks import source_key

        self.run, self.path, self.src, self.plan = run, path, src, run.plans[path]
        self.own = None
        self.ann = None
        self.subs: list = []
        self.lines = None
        self.rebuilt = Rebuilds(run.resume)  # replaced once the new ones hold as far as the old
        self.finished = self.broken = False
        self.written, self.had_last = -1, -1  # the last frame index written; the last the outputs had
        self.source = src.source_id
        self.done_key = source_key(self.source)  # as done_places keys its lines
        self.pending: list = []  # frames waiting for their batch, in frame order

    def locate(self, count: int | None) -> None:
        """Every frame picked located (or, done before, replayed) into the outputs, which are
        closed whole however it ends."""
        from tqdm import tqdm

        from pipelines.resume import resumed_frames
        from pipelines.sinks import close_all
        from pipelines.sources import file_name

        run, plan, src, done, done_key = self.run, self.plan, self.src, self.run.done, self.done_key
        try:
            self._open()
            # Held by the run: a file stopped early (Ctrl-C, a write failed) leaves its bar as it
            # was, under the run's summary line, and it is closed only with the run.
            bar = run.bar = tqdm(total=count, desc=file_name(self.path), unit="frame", file=sys.stderr)
            shown = 0
            # a frame done before needs its pixels only to be drawn again
            need_rgb = None if plan.annotate else (lambda i: (done_key, i) not in done)
            # Resumed: the frames done are replayed from their lines, and the file is read from
            # the keyframe before the last of them (an --annotate MP4 draws them again: read all)
            recorded = {} if plan.annotate else {k[1]: float(r["pts"]) for k, r in done.items() if k[0] == done_key}
            for frame in resumed_frames(src, run.sampling, recorded, need_rgb=need_rgb):
                prior = done.get((done_key, frame.index))
                if prior is None:
                    self.pending.append(frame)
                    if len(self.pending) >= run.args.batch:
                        self._locate_pending()
                else:
                    self._replay(frame, prior)
                bar.update(src.decoded - shown)
                shown = src.decoded
            self._locate_pending()
            bar.update(src.decoded - shown)
            bar.close()
            if src.error:
                run.errors.append(src.error)
            run.incomplete += src.incomplete
            self.finished = True
        except OSError:
            self.broken = True
            raise
        finally:
            src.close()
            try:
                close_all((self.own, self.ann, *self.subs), src.end)
            except OSError:
                self.broken = True
                raise
            finally:  # stopped past the last frame they had: the rebuilt outputs go as far, and further
                self.rebuilt.finish(not self.broken and (self.finished or self.written >= self.had_last))

    def _open(self) -> None:
        """Its own JSONL and its subtitles (the --annotate MP4 waits for a frame's size)."""
        from pipelines.sinks import JsonlSink, SubtitleSink

        run, plan, done = self.run, self.plan, self.run.done
        if plan.jsonl:
            plan.jsonl.parent.mkdir(parents=True, exist_ok=True)
            # its own JSONL: its lines are this video's, whatever path they name
            done.update({(self.done_key, k[1]): r for k, r in run.resumed.pop(self.path, {}).items()})
            self.own = JsonlSink(plan.jsonl, append=run.resume)
        self.had_last = max((k[1] for k in done if k[0] == self.done_key), default=-1)
        self.lines = self.own or run.shared
        for sub_path, fmt in plan.subtitles:
            sub_path.parent.mkdir(parents=True, exist_ok=True)
            self.subs.append(SubtitleSink(self.rebuilt.path(sub_path), fmt, run.sampling.period(self.src.fps)))

    def _annotate(self, frame, pixels: list, info: str) -> None:
        from pipelines.annotated import AnnotatedVideoSink
        from pipelines.locator import draw, found_text

        if self.ann is None:
            self.plan.annotate.parent.mkdir(parents=True, exist_ok=True)
            h, w = frame.rgb.shape[:2]
            self.ann = AnnotatedVideoSink(self.rebuilt.path(self.plan.annotate), w, h,
                                          frame_duration=self.run.sampling.period(self.src.fps))
        self.ann.write_image(draw(frame.rgb, pixels, self.run.task), found_text(self.run.what, len(pixels)), info,
                             frame.pts)

    def _replay(self, frame, prior: dict) -> None:
        """--resume: a frame written before; drawn again into a new --annotate (after those before it)."""
        from pipelines.locator import found_text

        self._locate_pending()
        self.run.replayed += 1
        for sub in self.subs:
            sub.write_text(frame.pts, found_text(self.run.what, len(prior["pixels"])))
        if self.plan.annotate:
            self._annotate(frame, prior["pixels"], f"#{frame.index} {frame.pts:.3f}s")
        self.written = frame.index

    def _locate_pending(self) -> None:
        """The frames waiting, located in one batch and written."""
        run = self.run
        results = run.decoder.locate_batch([f.rgb for f in self.pending], run.what, run.task) if self.pending else []
        for frame, result in zip(self.pending, results):
            self._located(frame, result)
        self.pending.clear()

    def _located(self, frame, result: dict) -> None:
        """A frame located: counted, its subtitle, its line (with --changes only when the number
        found changed), drawn."""
        from pipelines.locator import found_text, pixel_places

        run = self.run
        h, w = frame.rgb.shape[:2]
        places = result[run.key]
        pixels = pixel_places(places, w, h, run.task)
        run.frames += 1
        run.found_total += len(places)
        for sub in self.subs:
            sub.write_text(frame.pts, found_text(run.what, len(places)))
        self._report(frame, places, pixels, result["timings_ms"], result.get("batch"))
        if self.plan.annotate:
            ms = result["timings_ms"].get("total", 0.0)
            self._annotate(frame, pixels, f"#{frame.index} {frame.pts:.3f}s  {ms:.0f} ms")
        self.written = frame.index

    def _report(self, frame, places: list, pixels: list, timings_ms: dict, batch: int | None) -> None:
        """Its JSON line, or its terminal line (none with --changes while the number stays)."""
        from tqdm import tqdm

        from pipelines.locator import count_change, draw, place_record, places_text
        from pipelines.sinks import save_snapshot

        run, changes, snapshots, source = self.run, self.run.changes, self.run.snapshots, self.source
        change = (None if changes is None else
                  count_change(changes, source, len(places), frame.pts, (frame, pixels)))
        if changes is not None and change is None:
            pass  # the same number as the last report: no line
        elif self.lines is not None:
            record = place_record(source, frame, run.task, run.what, places, pixels, timings_ms, batch)
            kept = change.pop("kept", None) if change else None
            if snapshots is not None:  # the frame the new count began on (--hold N: N-1 back)
                first, first_pixels = kept or (frame, pixels)
                change["snapshot"] = str(save_snapshot(snapshots, source, first.index,
                                                       draw(first.rgb, first_pixels, run.task)))
            self.lines.write_records([{**record, **(change or {}), "model": run.model, "load_ms": run.load_ms}])
        elif run.on_terminal:
            prefix = f"{run.names[self.path]}  " if len(run.paths) > 1 else ""
            was = "" if not change or change["previous"] is None else f"  (was {change['previous']} found)"
            tqdm.write(f"{prefix}{frame.pts:9.3f}  {run.what}: {places_text(pixels, run.task)}{was}")
