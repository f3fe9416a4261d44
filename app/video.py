"""`vlmstream video`: see `vlmstream video --help` and the README."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from app.cli import UsageError, check_changes_args, reading_arg, realtime_dtype, sticky_arg
from app.launcher import stop_requested
from app.outputs import (FORMATS, Rebuilds, check_not_inputs, check_writable, folder_arg, parse_formats,
                         plan_outputs, read_resumed)
from app.parser import LOCATE_BATCH
from app.prompt_args import check_constraints, prompt_tasks


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.types import SamplingParams
    from concurrent.futures import ThreadPoolExecutor, wait

    from pipelines.batch import MAX_FPS, BatchSummary, Sampling, caption_file, merge
    from pipelines.changes import AnswerChanges, ChangedAnswersSink
    from pipelines.prompts import prompt_key, prompt_label
    from pipelines.annotated import AnnotatedVideoSink
    from pipelines.sinks import JsonlSink, SubtitleSink, done_frames, source_key
    from pipelines.sources import FileSource, SourceError, file_name

    if args.fps is not None and not 0 < args.fps <= MAX_FPS or args.every_n is not None and args.every_n < 1:
        raise UsageError(f"--fps must be a finite number > 0 (at most {MAX_FPS:g}) and --every-n >= 1")  # NaN too
    tasks = prompt_tasks(args)
    one_prompt = tasks[0] if len(tasks) == 1 else None  # what a JSONL line without a prompt answered
    out_dir, ann_dir = folder_arg(args.output), folder_arg(args.annotate)
    to_stdout = args.output == "-"  # JSON lines on standard output, for piping
    out = None if out_dir or not args.output or to_stdout else Path(args.output)
    kind = "jsonl" if to_stdout else out.suffix.lower().lstrip(".") if out else None
    if out and kind not in FORMATS:
        raise UsageError("-o must end in .jsonl, .srt or .vtt, or name a folder (end it with /)")
    if args.annotate and not ann_dir and Path(args.annotate).suffix.lower() != ".mp4":
        raise UsageError("--annotate must end in .mp4, or name a folder (end it with /)")
    if args.format and not out_dir:
        raise UsageError("--format goes with -o FOLDER/ (a file's extension gives its format)")
    formats = parse_formats(args.format or "jsonl") if out_dir else ()
    locate = args.detect is not None or args.point is not None
    if locate:
        from app.prompt_args import region_task

        task, what = region_task(args)
        args.batch = LOCATE_BATCH if args.batch is None else args.batch
        if args.batch < 1:
            raise UsageError("--batch must be >= 1")
    elif args.batch is not None:
        raise UsageError("--batch goes with --detect/--point (captions are batched by the engine)")
    paths, skipped, copies = _inputs(args.files, exclude=ann_dir)
    if len(paths) > 1 and kind in ("srt", "vtt"):
        raise UsageError(f"several files need a folder for their subtitles: -o FOLDER/ --format {kind}")
    if len(paths) > 1 and args.annotate and not ann_dir:
        raise UsageError("several files need a folder for their annotated videos: --annotate FOLDER/")
    if args.resume and to_stdout:
        raise UsageError("--resume needs a JSONL file to read back, not -o -")
    if args.resume and kind != "jsonl" and "jsonl" not in formats:
        raise UsageError("--resume needs -o OUT.jsonl, or -o FOLDER/ with jsonl among its --format")
    sticky = sticky_arg(args)
    check_changes_args(args)
    if args.changes and args.resume:
        raise UsageError("--changes writes only the answers that changed: --resume could not tell the frames done")
    if args.changes and (kind in ("srt", "vtt") or out_dir and "jsonl" not in formats):
        raise UsageError("--changes reports in JSONL or on the terminal (subtitles merge repeated captions already)")
    snapshots = Path(args.snapshots) if args.snapshots else None
    if snapshots and not (kind == "jsonl" or "jsonl" in formats):
        raise UsageError("--snapshots needs a JSONL output (-o OUT.jsonl, -o -, or -o FOLDER/), whose lines name "
                         "the pictures")
    if snapshots and out and resolved(snapshots) == resolved(out):  # it was made, then -o failed on it
        raise UsageError(f"--snapshots {snapshots} is -o's file: the pictures need a folder")
    if snapshots:
        check_writable([snapshots], [])
    ann_file = Path(args.annotate) if args.annotate and not ann_dir else None
    plans = plan_outputs(paths, out_dir, formats, ann_dir, ann_file, (out, kind) if kind in ("srt", "vtt") else None)
    if out is not None and kind == "jsonl":  # a link named .jsonl to a video had been cut and appended to
        check_not_inputs([out], [p for p, _, _ in paths])
    check_writable([d for d in (out_dir, ann_dir) if d], [p for p in (out, ann_file) if p])
    if copies:  # once the run is sure to go (a mistake is its one line alone)
        print(f"vlmstream: note: {_copies(copies)} left out (name one to caption it)", file=sys.stderr)
    if locate:  # places, through the region head: a path of its own (app/video_locate.py)
        from app import video_locate

        return video_locate.run(args, paths, plans, out, to_stdout, Sampling(fps=args.fps, every_n=args.every_n),
                                skipped, task, what)
    params = SamplingParams(max_tokens=args.max_tokens, sticky=sticky)
    sampling = Sampling(fps=args.fps, every_n=args.every_n)
    reading = reading_arg(args)
    def warn(message: str) -> None:
        print(f"vlmstream: warning: {message}", file=sys.stderr)

    done, resumed = read_resumed(lambda p: done_frames(p, one_prompt, warn), lambda r: r.model,
                                 out if kind == "jsonl" else None, plans, args.model,
                                 "answers") if args.resume else ({}, {})
    shared = None  # the one JSONL of every file: opened (afresh, without --resume) once the model is up
    stop, write_failed, pipe_closed = threading.Event(), threading.Event(), threading.Event()
    print_lock = threading.Lock()
    # Up to CONCURRENT_FILES run side by side, each with a bar of its own; more files than that
    # share one bar over all their frames, so a folder of hundreds does not print hundreds of bars.
    overall = None
    counts = {p: n for p, n, _ in paths}  # the frames each file announces (None: it does not say)
    if len(paths) > CONCURRENT_FILES:
        # A file that announces no frame count (a raw .h264 camera export) adds its frames as they
        # are read, and each file's count is set right at its end: one such file had taken the
        # total, and with it the ETA, off a whole folder's bar.
        overall = tqdm(total=sum(n for n in counts.values() if n) or None, desc=f"{len(paths)} files",
                       unit="frame", file=sys.stderr)
        overall.set_postfix(files_done=0)
    files_done = 0
    trackers: list = []  # with --changes: every AnswerChanges, for the count of changes

    def jsonl_sink(sink: JsonlSink):
        if not args.changes:
            return sink
        filtered = ChangedAnswersSink(sink, args.hold or 1, snapshots)
        trackers.append(filtered.changes)
        return filtered

    def process(i: int, path: str) -> BatchSummary:
        nonlocal files_done
        summary = BatchSummary()
        plan = plans[path]
        if stop.is_set():  # interrupted before this file's turn
            return summary
        try:
            src = FileSource(path, reading=reading)  # probed already; opened only now: a folder may hold thousands
        except SourceError as e:  # changed since it was probed
            summary.errors.append(str(e))
            summary.incomplete += 1
            return summary
        name = file_name(path)
        sinks: list = [shared] if shared else []
        bar = None if overall is not None else tqdm(total=src.frame_count, desc=name, unit="frame", position=i,
                                                    leave=True, file=sys.stderr)
        shown = 0
        on_terminal = out is None and not out_dir and not to_stdout
        changed = AnswerChanges(args.hold or 1) if args.changes and on_terminal else None
        if changed:
            trackers.append(changed)

        def advance() -> None:  # with print_lock held
            nonlocal shown
            step = max(0, summary.frames_decoded - shown)
            if bar is None and not counts[path] and overall.total is not None:
                overall.total += step
            # `is None`, not truth: a bar without a total (the container gives no frame count)
            # has no truth value in tqdm, and asking raised TypeError
            (overall if bar is None else bar).update(step)
            shown = max(shown, summary.frames_decoded)

        def show(r) -> None:
            nonlocal written_last
            written_last = max(written_last, r.index)  # every answer, replayed or new, once written
            with print_lock:
                advance()
                if on_terminal:
                    prefix = f"{name}  " if len(paths) > 1 else ""
                    asked = "" if one_prompt else f"{prompt_label(r.prompt)}: "
                    pts, text, was = r.pts, r.text.strip(), ""
                    if changed is not None:
                        c = changed.observe(prompt_key(r.prompt), r.text, r.pts)
                        if c is None:
                            return
                        pts, was = c.since_pts, "" if c.previous is None else f"  (was: {c.previous})"
                    print(f"{prefix}{pts:9.3f}  {asked}{text}{was}", flush=True)

        rebuilt = Rebuilds(args.resume)  # replaced once the new ones hold as far as the old
        finished, broken, had_last, written_last = False, False, -1, -1

        try:
            file_done = done
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
            src = FileSource(path, reading=reading)
            here = source_key(src.source_id)
            if plan.jsonl:
                plan.jsonl.parent.mkdir(parents=True, exist_ok=True)
                # The file's own JSONL: its answers are this video's, whatever path they name (one
                # relative to where the first run ran, resumed from elsewhere, was asked again).
                file_done = {(here, *k[1:]): r for k, r in resumed.pop(path, {}).items()}
                sinks.append(jsonl_sink(JsonlSink(plan.jsonl, append=args.resume)))
            had_last = max((k[1] for k in file_done if k[0] == here), default=-1)  # the outputs' last frame
            for sub_path, fmt in plan.subtitles:
                sub_path.parent.mkdir(parents=True, exist_ok=True)
                sinks.append(SubtitleSink(rebuilt.path(sub_path), fmt, sampling.period(src.fps)))
            if plan.annotate:
                plan.annotate.parent.mkdir(parents=True, exist_ok=True)
                sinks.append(AnnotatedVideoSink(rebuilt.path(plan.annotate), first.rgb.shape[1], first.rgb.shape[0]))
            caption_file(engine, src, sinks, tasks, params, sampling, file_done, on_frame=show, summary=summary,
                         stop=stop)
            finished = True
        except KeyboardInterrupt:  # stopped by the flag: the summary still counts what was written
            stop.set()
        except BrokenPipeError:  # -o - piped into a reader that has had enough (`head`): stop quietly
            pipe_closed.set()
            stop.set()
        except OSError as e:  # an output cannot be written (disk full, permissions): this file fails
            write_failed.set()
            broken = True
            summary.errors.append(f"{path}: cannot write its results: {e}")
        finally:
            with print_lock:
                advance()  # frames after the last one picked
                if bar is not None:
                    bar.close()
                else:
                    files_done += 1
                    if counts[path] and overall.total is not None:  # what it held, not what it announced
                        overall.total += summary.frames_decoded - counts[path]
                    overall.set_postfix(files_done=files_done)
            for sink in sinks:
                if sink is not shared:
                    try:
                        sink.close(src.end)
                    except OSError as e:  # named: the others (on another disk, say) are whole
                        write_failed.set()
                        broken = True
                        said = f"{path}: cannot write {getattr(sink, 'path', None) or 'its results'}: {e.strerror or e}"
                        if said not in summary.errors:
                            summary.errors.append(said)
            # Stopped past the last frame they had: the rebuilt outputs go as far, and further.
            try:
                rebuilt.finish(not broken and (finished or written_last >= had_last))
            except OSError as e:
                write_failed.set()
                summary.errors.append(f"{path}: cannot put its rebuilt outputs in place: {e.strerror or e}")
            src.close()
        return summary

    from engine import Engine, EngineConfig  # torch: after every argument is checked

    interrupted = False
    summaries: list[BatchSummary] = []
    with Engine(EngineConfig(model=args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype),
                             vision_thread=False if args.no_vision_thread else None)) as engine:
        check_constraints(engine, tasks)  # before any output is touched
        made = out is not None and kind == "jsonl" and not out.exists()  # removed again if the run gives nothing
        shared = jsonl_sink(JsonlSink(sys.stdout if to_stdout else out, append=args.resume)) if kind == "jsonl" else None
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(CONCURRENT_FILES, len(paths))) as pool:
            futures = [pool.submit(process, i, path) for i, (path, _, _) in enumerate(paths)]
            try:
                # Poll: a SIGINT the kernel hands to a worker thread is only noticed by the main
                # thread when it next wakes, so it must never block without a timeout.
                while wait(futures, timeout=0.1).not_done:
                    if stop_requested():  # a SIGTERM whose KeyboardInterrupt was lost (in a finalizer)
                        raise KeyboardInterrupt
                summaries += [f.result() for f in futures]
            except KeyboardInterrupt:  # Ctrl-C: the workers stop at their next frame
                interrupted, first = True, time.perf_counter()
                stop.set()
                while True:
                    try:
                        summaries += [f.result() for f in futures if not f.cancelled()]
                        break
                    except KeyboardInterrupt:
                        # The same stop twice (GNU timeout signals the command and its group): the
                        # summary was lost to it. A second Ctrl-C later than that is a hurry: it goes.
                        if time.perf_counter() - first > DOUBLE_SIGNAL_S:
                            raise
            finally:
                # However the wait ended: a second SIGINT that came before the handler's stop.set()
                # escaped it, and the pool's exit then waited for workers never told to stop (every
                # file captioned to its end, then exit 130 without a summary).
                stop.set()
        wall_s = time.perf_counter() - t0
    if overall is not None:
        overall.close()
    if shared:
        shared.close()
    summary = merge(summaries)
    summary.seconds = wall_s  # files ran side by side, and more than CONCURRENT_FILES one after another
    # Nothing answered and nothing to resume from: every file failed (unreadable, no frame). Said
    # as errors, with no "0 frames captioned" summary, and the JSONL this run made goes again.
    failed = (bool(summary.errors) and summary.frames_captioned == 0 and not summary.frames_skipped
              and not interrupted and not write_failed.is_set() and not pipe_closed.is_set())
    for err in summary.errors:
        print(f"vlmstream: {'error' if failed else 'warning'}: {err}", file=sys.stderr)
    if failed:
        if made and out.exists() and out.stat().st_size == 0:
            out.unlink()
        return 2
    speed = summary.video_seconds / summary.seconds if summary.seconds else 0.0
    print(f"vlmstream: {summary.frames_captioned} frames captioned, {summary.frames_skipped} skipped (resume), "
          f"{summary.files} file(s)" + (f", {len(skipped)} unreadable skipped" if skipped else "")
          + (f", {sum(t.count for t in trackers)} changes" if args.changes else "")
          + f", {speed:.1f}x real time" + (f", outputs in {out_dir}" if out_dir else "")
          + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    if pipe_closed.is_set():
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
    if interrupted:
        return 130
    if write_failed.is_set():
        return 1
    # Some of the work is missing (a file unreadable, cut off, or its outputs unwritable), the
    # rest is whole: 1, so that a script (`vlmstream video dir/ && upload`) sees it. With 0, a
    # folder with a broken clip looked done. Damaged packets skipped on the way are a warning.
    return 1 if summary.incomplete or skipped else 0


CONCURRENT_FILES = 4  # files captioned side by side, sharing the engine
DOUBLE_SIGNAL_S = 1.0  # a second interrupt this soon after the first is the same one


def _inputs(names: list[str], exclude: Path | None = None
            ) -> tuple[list[tuple[str, int | None, Path]], list[str], int]:
    """The files to caption, each with its announced frame count and its name relative to the
    folder it was found in (a named file: its own name), and the files skipped.

    A folder stands for the videos under it (`video_files`). Every file is opened once here and
    closed again, so a named file that is missing or unreadable stops the run before it starts
    (SourceError); one found in a folder is skipped with a warning instead: one broken clip must
    not hold up a folder of good ones. A file named twice is a mistake (UsageError); one reached
    twice through folders is taken once. Videos in an output folder (`exclude`) inside an input
    folder are an earlier run's annotated videos, not inputs; so are those vlmstream wrote
    anywhere in an input folder (counted: the third value)."""
    from pipelines.sources import FileSource, SourceError, file_name, video_files

    if len(set(names)) != len(names):
        raise UsageError("a file is listed twice")
    if "-" in names and not Path("-").exists():  # it said "video not found: -"
        raise UsageError("video reads files, not standard input: `vlmstream live -` captions a stream piped in")
    excluded = resolved(exclude) if exclude else None
    found: list[tuple[str, Path | None]] = []  # a named file keeps its spelling: it is the JSONL's source
    for name in names:
        p = Path(name)
        if p.is_dir():
            videos = video_files(p)
            if excluded and excluded == resolved(p):  # a second run would take the annotated videos for inputs
                raise UsageError(f"--annotate {exclude} is an input folder: give the annotated videos a folder of "
                                 f"their own (a subfolder will do: --annotate {exclude / 'annotated'}/)")
            if excluded and excluded.is_relative_to(resolved(p)):
                videos = [v for v in videos if not resolved(v).is_relative_to(excluded)]
            if not videos:
                raise UsageError(f"no video files in {p} (looked for .mp4, .mkv, .webm, .mov, .avi and other "
                                 "video extensions, in subfolders too)")
            found += [(str(v), v.relative_to(p)) for v in videos]
        else:
            found.append((name, None))
    paths, seen, skipped, copies = [], set(), [], 0
    for p, rel in found:
        key = resolved(Path(p))
        if key in seen:
            continue
        seen.add(key)
        try:
            with FileSource(p) as src:
                if rel is not None and src.annotated:  # an earlier run's, annotated into a folder in here
                    copies += 1
                    seen.discard(key)  # named as well, it is captioned
                    continue
                paths.append((p, src.frame_count, rel or Path(file_name(p))))
        except SourceError as e:
            if rel is None:
                raise
            skipped.append(p)
            print(f"vlmstream: warning: skipped: {e}", file=sys.stderr)
    if not paths and copies and not skipped:
        raise UsageError(f"the videos found are {_copies(copies)}: name one to caption it")
    if not paths:
        raise UsageError(f"none of the {len(found)} video files found can be read")
    return paths, skipped, copies


def _copies(n: int) -> str:
    return f"{n} annotated cop{'y' if n == 1 else 'ies'} that vlmstream wrote"


def resolved(path: Path) -> Path:
    """The path with its links followed; a link that loops as it is, made absolute (resolve()
    raised RuntimeError: a traceback for a bad link in a folder of videos). Opening it says why."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))
