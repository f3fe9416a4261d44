"""`vlmstream eval-tiny`: see `vlmstream eval-tiny --help` and EVAL.md."""

from __future__ import annotations

import argparse

from app.cli import UsageError, print_report


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tinyvlm.evaluate import evaluate, format_report

    if args.n < 1:
        raise UsageError("--n must be >= 1")
    bar = None  # made at the first scene: a model that does not load prints its error alone

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="eval-tiny", unit="scene")  # on stderr, --json or not (a silent minute)
        bar.update(done - bar.n)

    try:
        report = evaluate(args.model, args.n, args.device, args.dtype, progress, args.renderer)
    finally:  # however it ends: a Ctrl-C's line came glued to the bar, and the bar again after it
        if bar is not None:
            bar.close()
    print_report(report, args.json, format_report)
    if report["interrupted"]:  # the scenes scored printed first: the exit still says it stopped
        raise KeyboardInterrupt(f"{report['scenes']} of {args.n} scenes scored")
    return 0
