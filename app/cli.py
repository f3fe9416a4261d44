"""`vlmstream` command line.

    vlmstream image IMAGE [--model tiny|DIR] (--caption short|normal|long | --question TEXT)
                          [--temperature T] [--top-p P] [--max-tokens N] [--seed S]
                          [--device cpu|cuda] [--dtype D] [--json]

User mistakes print one line `vlmstream: error: ...` on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from engine.errors import VlmstreamError

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlmstream", description="Real-time video understanding with a VLM.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    img = sub.add_parser("image", help="caption or ask a question about one image",
                         description="Caption an image or answer a question about it.")
    img.add_argument("image", metavar="IMAGE", help="path of an image file (any format Pillow reads)")
    _add_model_args(img)
    task = img.add_mutually_exclusive_group()
    task.add_argument("--caption", choices=["short", "normal", "long"],
                      help="caption length (default: normal, unless --question is given)")
    task.add_argument("--question", metavar="TEXT", help="a question about the image")
    _add_sampling_args(img)
    img.add_argument("--json", action="store_true",
                     help="print one JSON object: text, token_ids, finish_reason, timings_ms")
    img.set_defaults(func=_cmd_image)

    vid = sub.add_parser("video", help="caption video files frame by frame",
                         description="Caption (or ask about) the frames of video files; results in frame order.")
    vid.add_argument("files", nargs="+", metavar="FILE", help="video files (whatever FFmpeg reads)")
    vtask = vid.add_mutually_exclusive_group()
    vtask.add_argument("--caption", choices=["short", "normal", "long"], help="caption length (default short)")
    vtask.add_argument("--question", metavar="TEXT", help="a question asked about every processed frame")
    pick = vid.add_mutually_exclusive_group()
    pick.add_argument("--fps", type=float, metavar="N", help="process N frames per second of video")
    pick.add_argument("--every-n", type=int, metavar="N", help="process every Nth frame")
    pick.add_argument("--every-frame", action="store_true", help="process every frame (the default)")
    vid.add_argument("-o", "--output", metavar="OUT", help="write OUT.jsonl, OUT.srt or OUT.vtt (by extension)")
    vid.add_argument("--annotate", metavar="OUT.mp4", help="write an MP4 with captions and latency drawn")
    vid.add_argument("--resume", action="store_true", help="skip frames already in the -o JSONL")
    _add_model_args(vid)
    vid.add_argument("--max-tokens", type=int, default=64, metavar="N", help="answer length limit (default 64)")
    vid.set_defaults(func=_cmd_video)

    live = sub.add_parser("live", help="caption a live source frame by frame (latest frame wins)",
                          description="Caption a live source; a file is played in real time (looped to --duration).")
    live.add_argument("source", metavar="SOURCE", help="a video file (webcam:N and URLs: not yet)")
    ltask = live.add_mutually_exclusive_group()
    ltask.add_argument("--caption", choices=["short", "normal", "long"], help="caption length (default short)")
    ltask.add_argument("--question", metavar="TEXT")
    live.add_argument("--fps", type=float, default=60.0, help="highest intake rate (default 60)")
    live.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    live.add_argument("--max-inflight", type=int, default=2, metavar="N", help="frames in the engine at once (default 2)")
    live.add_argument("--deadline-ms", type=float, default=None, metavar="D", help="cancel a frame after D ms")
    live.add_argument("--max-tokens", type=int, default=32, metavar="N", help="answer length limit (default 32)")
    _add_model_args(live)
    live.add_argument("--json", action="store_true", help="print one final JSON object with the session's figures")
    live.set_defaults(func=_cmd_live)

    bench = sub.add_parser("bench", help="decode throughput: pipelined vs blocking",
                           description="Throughput of pipelined vs blocking decoding at several concurrencies.")
    _add_model_args(bench)
    bench.add_argument("--streams", default="1,8,32", metavar="N,N,...",
                       help="concurrent requests per run (default 1,8,32)")
    bench.add_argument("--tokens", type=int, default=64, metavar="N", help="answer tokens per request (default 64)")
    bench.add_argument("--repeats", type=int, default=3, metavar="N", help="runs per mode, medians (default 3)")
    bench.add_argument("--frames", type=int, default=240, metavar="N",
                       help="also caption N distinct 640x360 frames and report frames/s (0 skips; default 240)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.set_defaults(func=_cmd_bench)

    tr = sub.add_parser("train-tiny", help="train the embedded tiny model on generated scenes (CPU)",
                        description="Train the tiny model on the procedural scene world; deterministic for a seed.")
    tr.add_argument("--out", default=None, metavar="DIR", help="output folder (default: the embedded tiny folder)")
    tr.add_argument("--steps", type=int, default=6000, help="optimizer steps (default 6000)")
    tr.add_argument("--batch-size", type=int, default=16, help="images per step (default 16)")
    tr.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=2, help="torch threads for training (default 2)")
    tr.add_argument("--max-minutes", type=float, default=85.0, help="stop early after this long (default 85)")
    tr.set_defaults(func=_cmd_train)

    ev = sub.add_parser("eval-tiny", help="accuracy on held-out generated scenes",
                        description="Caption and question accuracy on scenes from a seed range never used in training.")
    ev.add_argument("--model", default="tiny", metavar="tiny|DIR")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--n", type=int, default=1000, help="held-out scenes (default 1000)")
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ev.set_defaults(func=_cmd_eval)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", metavar="tiny|DIR",
                   help="'tiny' (embedded default) or a local Moondream 2 folder (default: tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (default: float32 on cpu, bfloat16 on cuda)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (default); > 0 samples with top-p")
    p.add_argument("--top-p", type=float, default=0.3, metavar="P", help="nucleus mass, in (0, 1] (default 0.3)")
    p.add_argument("--max-tokens", type=int, default=768, metavar="N", help="answer length limit (default 768)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="sampling seed (default: a fresh one, reported with --json)")


def _cmd_image(args: argparse.Namespace) -> int:
    from engine.models.loader import load_model
    from engine.reference import ReferenceDecoder
    from engine.types import SamplingParams
    from pipelines.image_file import read_image

    # Validate everything cheap before the model loads.
    params = SamplingParams(args.temperature, args.top_p, args.max_tokens, args.seed)
    if args.question is not None and not args.question.strip():
        raise _UsageError("--question is empty")
    caption = args.caption or (None if args.question is not None else "normal")
    rgb = read_image(args.image)

    t0 = time.perf_counter()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    load_ms = (time.perf_counter() - t0) * 1000.0
    decoder = ReferenceDecoder(loaded)

    stream = not args.json
    out = sys.stdout

    def on_text(piece: str) -> None:
        out.write(piece)
        out.flush()

    result = decoder.generate(rgb, caption=caption, question=args.question, params=params,
                              on_text=on_text if stream else None)
    if args.json:
        json.dump({
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "timings_ms": result.timings.as_dict(),
            "model": args.model,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "seed": result.seed,
            "load_ms": round(load_ms, 3),
        }, out)
    out.write("\n")
    out.flush()
    return 0


def _cmd_video(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from engine import Engine, EngineConfig, SamplingParams
    from pipelines.batch import BatchSummary, Sampling, caption_file
    from pipelines.sinks import AnnotatedVideoSink, JsonlSink, SubtitleSink, done_frames
    from pipelines.sources import FileSource

    if args.fps is not None and args.fps <= 0 or args.every_n is not None and args.every_n < 1:
        raise _UsageError("--fps must be > 0 and --every-n >= 1")
    if args.question is not None and not args.question.strip():
        raise _UsageError("--question is empty")
    out = Path(args.output) if args.output else None
    kind = out.suffix.lower().lstrip(".") if out else None
    if out and kind not in ("jsonl", "srt", "vtt"):
        raise _UsageError("-o must end in .jsonl, .srt or .vtt")
    if len(args.files) > 1 and (kind in ("srt", "vtt") or args.annotate):
        raise _UsageError("subtitles and --annotate take one file at a time; use a .jsonl for several")
    if args.resume and kind != "jsonl":
        raise _UsageError("--resume needs -o OUT.jsonl")
    params = SamplingParams(max_tokens=args.max_tokens)
    task = {"question": args.question} if args.question else {"caption": args.caption or "short"}
    sampling = Sampling(fps=args.fps, every_n=args.every_n)
    sources = [FileSource(f) for f in args.files]  # open them all first: bad files fail fast
    done = done_frames(out) if args.resume else set()
    summary = BatchSummary()
    interrupted = False
    with Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype)) as engine:
        for src in sources:
            sinks = []
            if kind == "jsonl":
                sinks.append(JsonlSink(out))
            elif kind in ("srt", "vtt"):
                sinks.append(SubtitleSink(out, kind, 1.0 / (src.fps or 30.0)))
            first = None
            total = src.frame_count
            bar = tqdm(total=total, desc=Path(src.path).name, unit="frame", leave=True, file=sys.stderr)

            def show(r, bar=bar) -> None:
                bar.update(max(0, summary.frames_decoded - bar.n))
                if out is None:
                    print(f"{r.pts:9.3f}  {r.text.strip()}", flush=True)

            try:
                if args.annotate:
                    first = next(src.frames(), None)
                    src.close()
                    if first is not None:
                        src = FileSource(src.path)
                        sinks.append(AnnotatedVideoSink(args.annotate, first.rgb.shape[1], first.rgb.shape[0]))
                caption_file(engine, src, sinks, task, params, sampling, done, on_frame=show, summary=summary)
            except KeyboardInterrupt:
                interrupted = True
            finally:
                bar.close()
                for sink in sinks:
                    sink.close()
                src.close()
            if interrupted:
                break
    for err in summary.errors:
        print(f"vlmstream: warning: {err}", file=sys.stderr)
    speed = summary.video_seconds / summary.seconds if summary.seconds else 0.0
    print(f"vlmstream: {summary.frames_captioned} frames captioned, {summary.frames_skipped} skipped (resume), "
          f"{summary.files} file(s), {speed:.1f}x real time" + (" (interrupted)" if interrupted else ""),
          file=sys.stderr)
    if interrupted:
        return 130
    return 2 if summary.errors and summary.frames_captioned == 0 else 0


def _cmd_live(args: argparse.Namespace) -> int:
    from engine import Engine, EngineConfig, SamplingParams
    from pipelines.grabber import LatestFrameGrabber
    from pipelines.live import LiveSession
    from pipelines.sources import FileSource, SourceError

    if "://" in args.source or args.source.startswith("webcam:"):
        raise SourceError(f"{args.source.split(':')[0]} sources are not supported yet; give a video file")
    if args.fps <= 0 or args.max_inflight < 1 or (args.duration is not None and args.duration <= 0):
        raise _UsageError("--fps and --duration must be > 0, --max-inflight >= 1")
    if args.question is not None and not args.question.strip():
        raise _UsageError("--question is empty")
    FileSource(args.source).close()  # fail fast on a bad file
    task = {"question": args.question} if args.question else {"caption": args.caption or "short"}
    params = SamplingParams(max_tokens=args.max_tokens)

    def frames():
        src = FileSource(args.source, threads=False)
        try:
            yield from src.frames()
        finally:
            src.close()

    def show(r) -> None:
        if not args.json:
            print(f"{r.frame.pts:9.3f}  {r.end_to_end_ms:6.1f} ms  {r.output.text.strip()}", flush=True)

    interrupted = False
    with Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                             max_batch_size=max(4, args.max_inflight))) as engine:
        # warm-up: the first step pays one-time costs a live stream should not see
        engine.submit(next(frames()).rgb, params=params, **task).result(timeout=120)
        grabber = LatestFrameGrabber(frames, realtime=True, loop=args.duration is not None)
        session = LiveSession(engine, task, params, args.max_inflight, args.deadline_ms, on_result=show)
        t0, next_t = time.perf_counter(), 0.0
        try:
            while args.duration is None or time.perf_counter() - t0 < args.duration:
                frame = grabber.get(timeout=1.0)
                if frame is None:
                    if grabber.ended:
                        break
                    continue
                if time.perf_counter() - t0 < next_t:
                    continue  # faster than --fps: skip
                next_t = max(next_t + 1.0 / args.fps, time.perf_counter() - t0 - 1.0 / args.fps)
                session.offer(frame)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            grabber.close()
            session.close()
        stats = session.stats()
    stats["kv_pages_in_use_after"] = engine.stats().kv_pages_in_use
    stats["overwritten_at_grab"] = grabber.overwritten
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"vlmstream: {stats['completed']} of {stats['frames_in']} frames captioned, "
              f"{stats['achieved_fps']:.1f} fps, {stats['cancelled_stale']} stale cancelled, "
              f"{stats['dropped']} dropped, p50 {stats['latency_ms'].get('end_to_end', {}).get('p50', 0):.1f} ms",
              file=sys.stderr)
    return 130 if interrupted else 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from engine.bench import BenchConfig, format_table, run_bench

    try:
        streams = tuple(int(x) for x in args.streams.split(","))
    except ValueError:
        raise _UsageError(f"--streams must be comma-separated integers, got {args.streams!r}") from None
    if not streams or min(streams) < 1:
        raise _UsageError("--streams values must be >= 1")
    if args.tokens < 1 or args.repeats < 1 or args.frames < 0:
        raise _UsageError("--tokens and --repeats must be >= 1, --frames >= 0")
    cfg = BenchConfig(model=args.model, device=args.device, dtype=args.dtype, streams=streams,
                      tokens=args.tokens, repeats=args.repeats, frames=args.frames)
    total = len(streams) * 2 * args.repeats + (1 if args.frames else 0)
    done = [0]

    def progress(what: str) -> None:
        done[0] += 1
        print(f"[{done[0]}/{total}] {what}", file=sys.stderr, flush=True)

    report = run_bench(cfg, progress)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_table(report))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tinyvlm.train import TrainConfig, train

    if min(args.steps, args.batch_size, args.threads) < 1 or args.lr <= 0:
        raise _UsageError("--steps, --batch-size, --threads and --lr must be positive")
    kw = {} if args.out is None else {"out": Path(args.out)}
    report = train(TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                               threads=args.threads, max_minutes=args.max_minutes, **kw))
    print(json.dumps(report))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tinyvlm.evaluate import evaluate, format_report

    if args.n < 1:
        raise _UsageError("--n must be >= 1")
    bar = tqdm(total=args.n, desc="eval-tiny", unit="scene", disable=args.json)

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    report = evaluate(args.model, args.n, args.device, progress)
    bar.close()
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0


class _UsageError(VlmstreamError):
    pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except VlmstreamError as e:
        print(f"vlmstream: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("vlmstream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
