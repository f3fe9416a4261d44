"""`vlmstream bench`: see `vlmstream bench --help` and the README (engine/bench.py measures)."""

from __future__ import annotations

import argparse
import sys

from app.cli import print_report
from app.errors import UsageError

MAX_BENCH_STREAMS = 1024


def run(args: argparse.Namespace) -> int:
    from engine.bench import BenchConfig, format_table, run_bench

    try:
        streams = tuple(int(x) for x in args.streams.split(","))
    except ValueError:
        raise UsageError(f"--streams must be comma-separated integers, got {args.streams!r}") from None
    if not streams or min(streams) < 1 or max(streams) > MAX_BENCH_STREAMS:
        # each stream holds its own image: 100000 of them filled 10 GB before the first step
        raise UsageError(f"--streams values must be between 1 and {MAX_BENCH_STREAMS}")
    twice = sorted({n for n in streams if streams.count(n) > 1})
    if twice:  # measured twice, and an interrupted run's "not measured" missed the second
        raise UsageError(f"--streams names {', '.join(map(str, twice))} more than once")
    if args.tokens < 2:  # the decode rate counts the tokens after the first
        raise UsageError("--tokens must be >= 2 (decode throughput counts the tokens after the first)")
    if args.repeats < 1 or args.frames < 0:
        raise UsageError("--repeats must be >= 1, --frames >= 0")
    if not 0 <= args.seconds <= 3600:  # NaN too
        raise UsageError("--seconds must be between 0 and 3600")
    cfg = BenchConfig(model=args.model, device=args.device, dtype=args.dtype, streams=streams,
                      tokens=args.tokens, repeats=args.repeats, frames=args.frames, min_seconds=args.seconds,
                      cpu_script=False if args.no_script else None,
                      vision_thread=False if args.no_vision_thread else None)
    total = len(streams) * 2 * args.repeats + (1 if args.frames else 0)
    done = [0]

    def progress(what: str, counted: bool = True) -> None:
        done[0] += counted
        print(f"[{done[0]}/{total}] {what}", file=sys.stderr, flush=True)

    report = run_bench(cfg, progress)
    print_report(report, args.json, format_table)
    if report["interrupted"]:  # what was measured printed first: the exit still says it stopped
        raise KeyboardInterrupt(f"streams={','.join(map(str, report['not_measured']))} not measured"
                                if report["not_measured"] else "after the last measurement")
    return 0
