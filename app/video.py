"""`vlmstream video`: see `vlmstream video --help` and the README."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from app.cli import UsageError, realtime_dtype


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine import Engine, EngineConfig, SamplingParams
    from concurrent.futures import ThreadPoolExecutor, wait

    from pipelines.batch import BatchSummary, Sampling, caption_file, merge
    from pipelines.sinks import AnnotatedVideoSink, JsonlSink, SubtitleSink, done_frames
    from pipelines.sources import FileSource, SourceError

    if args.fps is not None and args.fps <= 0 or args.every_n is not None and args.every_n < 1:
        raise UsageError("--fps must be > 0 and --every-n >= 1")
    if args.question is not None and not args.question.strip():
        raise UsageError("--question is empty")
    out = Path(args.output) if args.output else None
    kind = out.suffix.lower().lstrip(".") if out else None
    if out and kind not in ("jsonl", "srt", "vtt"):
        raise UsageError("-o must end in .jsonl, .srt or .vtt")
    paths, skipped = _inputs(args.files)
    if len(paths) > 1 and (kind in ("srt", "vtt") or args.annotate):
        raise UsageError("subtitles and --annotate take one file at a time; use a .jsonl for several")
    if args.resume and kind != "jsonl":
        raise UsageError("--resume needs -o OUT.jsonl")
    params = SamplingParams(max_tokens=args.max_tokens)
    task = {"question": args.question} if args.question else {"caption": args.caption or "short"}
    sampling = Sampling(fps=args.fps, every_n=args.every_n)
    done = done_frames(out) if args.resume else set()
    shared = JsonlSink(out) if kind == "jsonl" else None
    stop = threading.Event()
    print_lock = threading.Lock()
    # Up to CONCURRENT_FILES run side by side, each with a bar of its own; more files than that
    # share one bar over all their frames, so a folder of hundreds does not print hundreds of bars.
    overall = None
    if len(paths) > CONCURRENT_FILES:
        known = [n for _, n in paths]
        overall = tqdm(total=sum(known) if all(known) else None, desc=f"{len(paths)} files", unit="frame",
                       file=sys.stderr)
        overall.set_postfix(files_done=0)
    files_done = 0

    def process(i: int, path: str) -> BatchSummary:
        nonlocal files_done
        summary = BatchSummary()
        if stop.is_set():  # interrupted before this file's turn
            return summary
        try:
            src = FileSource(path)  # probed already; opened only now: a folder may hold thousands
        except SourceError as e:  # changed since it was probed
            summary.errors.append(str(e))
            return summary
        name = Path(path).name
        sinks = [shared] if shared else []
        if kind in ("srt", "vtt"):
            sinks.append(SubtitleSink(out, kind, 1.0 / (src.fps or 30.0)))
        bar = None if overall else tqdm(total=src.frame_count, desc=name, unit="frame", position=i,
                                        leave=True, file=sys.stderr)
        shown = 0

        def show(r) -> None:
            nonlocal shown
            with print_lock:
                (bar or overall).update(max(0, summary.frames_decoded - shown))
                shown = max(shown, summary.frames_decoded)
                if out is None:
                    prefix = f"{name}  " if len(paths) > 1 else ""
                    print(f"{prefix}{r.pts:9.3f}  {r.text.strip()}", flush=True)

        try:
            if args.annotate:
                first = next(src.frames(), None)
                src.close()
                src = FileSource(path)
                if first is not None:
                    sinks.append(AnnotatedVideoSink(args.annotate, first.rgb.shape[1], first.rgb.shape[0]))
            caption_file(engine, src, sinks, task, params, sampling, done, on_frame=show, summary=summary, stop=stop)
        except KeyboardInterrupt:  # stopped by the flag: the summary still counts what was written
            stop.set()
        finally:
            if bar:
                bar.close()
            else:
                with print_lock:
                    files_done += 1
                    overall.update(max(0, summary.frames_decoded - shown))
                    overall.set_postfix(files_done=files_done)
            for sink in sinks:
                if sink is not shared:
                    sink.close()
            src.close()
        return summary

    interrupted = False
    summaries: list[BatchSummary] = []
    with Engine(EngineConfig(model=args.model, device=args.device,
                             dtype=realtime_dtype(args.device, args.dtype))) as engine:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(CONCURRENT_FILES, len(paths))) as pool:
            futures = [pool.submit(process, i, path) for i, (path, _) in enumerate(paths)]
            try:
                # Poll: a SIGINT the kernel hands to a worker thread is only noticed by the main
                # thread when it next wakes, so it must never block without a timeout.
                while wait(futures, timeout=0.1).not_done:
                    pass
                summaries += [f.result() for f in futures]
            except KeyboardInterrupt:  # Ctrl-C: the workers stop at their next frame
                interrupted = True
                stop.set()
                summaries += [f.result() for f in futures if not f.cancelled()]
        wall_s = time.perf_counter() - t0
    if overall:
        overall.close()
    if shared:
        shared.close()
    summary = merge(summaries)
    summary.seconds = wall_s  # files ran side by side, and more than CONCURRENT_FILES one after another
    for err in summary.errors:
        print(f"vlmstream: warning: {err}", file=sys.stderr)
    speed = summary.video_seconds / summary.seconds if summary.seconds else 0.0
    print(f"vlmstream: {summary.frames_captioned} frames captioned, {summary.frames_skipped} skipped (resume), "
          f"{summary.files} file(s)" + (f", {len(skipped)} unreadable skipped" if skipped else "")
          + f", {speed:.1f}x real time" + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    if interrupted:
        return 130
    return 2 if summary.errors and summary.frames_captioned == 0 else 0


CONCURRENT_FILES = 4  # files captioned side by side, sharing the engine


def _inputs(names: list[str]) -> tuple[list[tuple[str, int | None]], list[str]]:
    """The files to caption, each with its announced frame count, and the files skipped.

    A folder stands for the videos under it (`video_files`). Every file is opened once here and
    closed again, so a named file that is missing or unreadable stops the run before it starts
    (SourceError); one found in a folder is skipped with a warning instead: one broken clip must
    not hold up a folder of good ones. A file named twice is a mistake (UsageError); one reached
    twice through folders is taken once."""
    from pipelines.sources import FileSource, SourceError, video_files

    if len(set(names)) != len(names):
        raise UsageError("a file is listed twice")
    found: list[tuple[str, bool]] = []  # a named file keeps its spelling: it is the JSONL's source
    for name in names:
        p = Path(name)
        if p.is_dir():
            videos = video_files(p)
            if not videos:
                raise UsageError(f"no video files in {p} (looked for .mp4, .mkv, .webm, .mov, .avi and other "
                                 "video extensions, in subfolders too)")
            found += [(str(v), True) for v in videos]
        else:
            found.append((name, False))
    paths, seen, skipped = [], set(), []
    for p, from_folder in found:
        key = Path(p).resolve()
        if key in seen:
            continue
        seen.add(key)
        try:
            with FileSource(p) as src:
                paths.append((p, src.frame_count))
        except SourceError as e:
            if not from_folder:
                raise
            skipped.append(p)
            print(f"vlmstream: warning: skipped: {e}", file=sys.stderr)
    if not paths:
        raise UsageError(f"none of the {len(found)} video files found can be read")
    return paths, skipped
