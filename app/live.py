"""`vlmstream live`: see `vlmstream live --help` and the README."""

from __future__ import annotations

import argparse
import json
import sys
import time

from app.cli import UsageError, realtime_dtype


def run(args: argparse.Namespace) -> int:
    from engine import Engine, EngineConfig, SamplingParams
    from pipelines.grabber import LatestFrameGrabber
    from pipelines.live import LiveSession
    from pipelines.sources import FileSource, SourceError, StreamSource, WebcamSource, parse_webcam

    import numpy as np

    camera = parse_webcam(args.source)
    network = "://" in args.source
    if args.fps <= 0 or args.max_inflight < 1 or (args.duration is not None and args.duration <= 0):
        raise UsageError("--fps and --duration must be > 0, --max-inflight >= 1")
    if args.question is not None and not args.question.strip():
        raise UsageError("--question is empty")
    if camera is not None:
        stream = WebcamSource(camera)  # fails now if there is no camera
        network = True  # like a stream: already real time, nothing to loop
    elif network:
        stream = StreamSource(args.source)  # checks the scheme; redacts credentials
    else:
        FileSource(args.source).close()  # fail fast on a bad file
    task = {"question": args.question} if args.question else {"caption": args.caption or "short"}
    params = SamplingParams(max_tokens=args.max_tokens)

    def frames():
        if network:
            yield from stream.frames()
            return
        src = FileSource(args.source, threads=False)
        try:
            yield from src.frames()
        finally:
            src.close()

    def show(r) -> None:
        if not args.json:
            print(f"{r.frame.pts:9.3f}  {r.end_to_end_ms:6.1f} ms  {r.output.text.strip()}", flush=True)

    interrupted = False
    with Engine(EngineConfig(model=args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype),
                             max_batch_size=max(4, args.max_inflight))) as engine:
        # warm-up: the first step pays one-time costs a live stream should not see
        warm = np.zeros((240, 320, 3), np.uint8) if network else next(frames()).rgb
        engine.submit(warm, params=params, **task).result(timeout=120)
        grabber = LatestFrameGrabber(frames, realtime=not network, loop=args.duration is not None and not network)
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
        except SourceError as e:  # the stream stayed unreachable: report what we have
            if not session.frames_in:
                raise
            print(f"vlmstream: warning: {e}", file=sys.stderr)
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
