"""`vlmstream live`: see `vlmstream live --help` and the README."""

from __future__ import annotations

import argparse
import json
import sys
import time

from app.cli import UsageError, realtime_dtype


def run(args: argparse.Namespace) -> int:
    from engine import Engine, EngineConfig, SamplingParams
    from pipelines.feed import LiveFeed
    from pipelines.sources import SourceError, open_live

    import numpy as np

    if args.fps <= 0 or args.max_inflight < 1 or (args.duration is not None and args.duration <= 0):
        raise UsageError("--fps and --duration must be > 0, --max-inflight >= 1")
    if args.question is not None and not args.question.strip():
        raise UsageError("--question is empty")
    log = _open_log(args.output, args.json)
    frames, recorded = open_live(args.source)
    task = {"question": args.question} if args.question else {"caption": args.caption or "short"}
    params = SamplingParams(max_tokens=args.max_tokens)
    log_error: list[OSError] = []

    def show(r) -> None:
        if log is not None and not log_error:
            try:
                log.write(json.dumps(_record(r), ensure_ascii=False) + "\n")
                log.flush()
            except OSError as e:  # disk full, a closed pipe: the run stops and says so
                log_error.append(e)
        if not args.json and log is not sys.stdout:
            print(f"{r.frame.pts:9.3f}  {r.end_to_end_ms:6.1f} ms  {r.output.text.strip()}", flush=True)

    interrupted = False
    with Engine(EngineConfig(model=args.model, device=args.device, dtype=realtime_dtype(args.device, args.dtype),
                             max_batch_size=max(4, args.max_inflight), max_draft=0 if args.no_draft else EngineConfig.max_draft)) as engine:
        # warm-up: the first step pays one-time costs a live stream should not see
        warm = next(frames()).rgb if recorded else np.zeros((240, 320, 3), np.uint8)
        engine.submit(warm, params=params, **task).result(timeout=120)
        feed = LiveFeed(engine, task, params, frames, realtime=recorded,
                        loop=args.duration is not None and recorded, fps=args.fps,
                        max_inflight=args.max_inflight, deadline_ms=args.deadline_ms, on_result=show)
        t0 = time.perf_counter()
        try:
            while feed.running and not log_error and (args.duration is None or time.perf_counter() - t0 < args.duration):
                time.sleep(0.05)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            feed.close(cancel=False)
        if isinstance(feed.exception, SourceError) and not feed.session.frames_in:
            raise feed.exception  # nothing was ever read: a plain error
        if feed.error:  # the stream broke off after a while: report what we have
            print(f"vlmstream: warning: {feed.error}", file=sys.stderr)
        stats = feed.snapshot().counters
    if log is not None and log is not sys.stdout:
        log.close()
    if log_error:
        if isinstance(log_error[0], BrokenPipeError):  # e.g. piped into `head`
            return 0
        print(f"vlmstream: error: cannot write {args.output}: {log_error[0]}", file=sys.stderr)
        return 1
    es = engine.stats()
    stats["kv_pages_in_use_after"] = es.kv_pages_in_use
    stats["draft_tokens"] = {"proposed": es.draft_proposed, "accepted": es.draft_accepted}
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"vlmstream: {stats['completed']} of {stats['frames_in']} frames captioned, "
              f"{stats['achieved_fps']:.1f} fps, {stats['cancelled_stale']} stale cancelled, "
              f"{stats['dropped']} dropped, p50 {stats['latency_ms'].get('end_to_end', {}).get('p50', 0):.1f} ms",
              file=sys.stderr)
    return 130 if interrupted else 0


def _open_log(output: str | None, final_json: bool):
    """The per-frame log: None, standard output ('-'), or a file opened for appending (a
    restarted stream continues its log). A path that cannot be written is a UsageError now."""
    if output is None:
        return None
    if output == "-":
        if final_json:
            raise UsageError("--json and -o - would both write to standard output")
        return sys.stdout
    try:
        return open(output, "a", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror or e}") from None


def _record(r) -> dict:
    """One JSON line of the log: the fields of `video`'s JSONL, plus the wall-clock time of the
    result and its end-to-end latency among the timings."""
    from datetime import datetime, timezone

    return {"source": r.frame.source_id, "index": r.frame.index, "pts": round(r.frame.pts, 6),
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "text": r.output.text, "token_ids": r.output.token_ids, "finish_reason": r.output.finish_reason,
            "timings_ms": {**r.output.timings_ms, "end_to_end": round(r.end_to_end_ms, 3)}}
