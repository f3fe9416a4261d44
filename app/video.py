"""`vlmstream video`: see `vlmstream video --help` and the README."""

from __future__ import annotations

import argparse
import sys
import threading

from app.cli import UsageError, realtime_dtype


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from engine import Engine, EngineConfig, SamplingParams
    from concurrent.futures import ThreadPoolExecutor, wait

    from pipelines.batch import BatchSummary, Sampling, caption_file, merge
    from pipelines.sinks import AnnotatedVideoSink, JsonlSink, SubtitleSink, done_frames
    from pipelines.sources import FileSource

    if args.fps is not None and args.fps <= 0 or args.every_n is not None and args.every_n < 1:
        raise UsageError("--fps must be > 0 and --every-n >= 1")
    if args.question is not None and not args.question.strip():
        raise UsageError("--question is empty")
    out = Path(args.output) if args.output else None
    kind = out.suffix.lower().lstrip(".") if out else None
    if out and kind not in ("jsonl", "srt", "vtt"):
        raise UsageError("-o must end in .jsonl, .srt or .vtt")
    if len(args.files) > 1 and (kind in ("srt", "vtt") or args.annotate):
        raise UsageError("subtitles and --annotate take one file at a time; use a .jsonl for several")
    if len(set(args.files)) != len(args.files):
        raise UsageError("a file is listed twice")
    if args.resume and kind != "jsonl":
        raise UsageError("--resume needs -o OUT.jsonl")
    params = SamplingParams(max_tokens=args.max_tokens)
    task = {"question": args.question} if args.question else {"caption": args.caption or "short"}
    sampling = Sampling(fps=args.fps, every_n=args.every_n)
    sources = [FileSource(f) for f in args.files]  # open them all first: bad files fail fast
    done = done_frames(out) if args.resume else set()
    shared = JsonlSink(out) if kind == "jsonl" else None
    stop = threading.Event()
    print_lock = threading.Lock()

    def process(i: int, src) -> BatchSummary:
        summary = BatchSummary()
        sinks = [shared] if shared else []
        if kind in ("srt", "vtt"):
            sinks.append(SubtitleSink(out, kind, 1.0 / (src.fps or 30.0)))
        bar = tqdm(total=src.frame_count, desc=Path(src.path).name, unit="frame", position=i, leave=True,
                   file=sys.stderr)

        def show(r) -> None:
            bar.update(max(0, summary.frames_decoded - bar.n))
            if out is None:
                with print_lock:
                    prefix = f"{Path(r.source).name}  " if len(sources) > 1 else ""
                    print(f"{prefix}{r.pts:9.3f}  {r.text.strip()}", flush=True)

        try:
            if args.annotate:
                first = next(src.frames(), None)
                src.close()
                src = FileSource(src.path)
                if first is not None:
                    sinks.append(AnnotatedVideoSink(args.annotate, first.rgb.shape[1], first.rgb.shape[0]))
            caption_file(engine, src, sinks, task, params, sampling, done, on_frame=show, summary=summary, stop=stop)
        except KeyboardInterrupt:  # stopped by the flag: the summary still counts what was written
            stop.set()
        finally:
            bar.close()
            for sink in sinks:
                if sink is not shared:
                    sink.close()
            src.close()
        return summary

    interrupted = False
    summaries: list[BatchSummary] = []
    with Engine(EngineConfig(model=args.model, device=args.device,
                             dtype=realtime_dtype(args.device, args.dtype))) as engine:
        with ThreadPoolExecutor(max_workers=min(4, len(sources))) as pool:
            futures = [pool.submit(process, i, src) for i, src in enumerate(sources)]
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
    if shared:
        shared.close()
    summary = merge(summaries)
    for err in summary.errors:
        print(f"vlmstream: warning: {err}", file=sys.stderr)
    speed = summary.video_seconds / summary.seconds if summary.seconds else 0.0
    print(f"vlmstream: {summary.frames_captioned} frames captioned, {summary.frames_skipped} skipped (resume), "
          f"{summary.files} file(s), {speed:.1f}x real time" + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    if interrupted:
        return 130
    return 2 if summary.errors and summary.frames_captioned == 0 else 0
