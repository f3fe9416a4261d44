"""`vlmstream train-tiny`: see `vlmstream train-tiny --help` and EVAL.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.cli import UsageError
from app.outputs import check_writable


def run(args: argparse.Namespace) -> int:
    from tinyvlm.train import TrainConfig, train

    if min(args.steps, args.batch_size, args.threads, args.processes) < 1:
        raise UsageError("--steps, --batch-size, --threads and --processes must be positive")
    kw = {} if args.out is None else {"out": Path(args.out)}
    try:
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                          threads=args.threads, max_minutes=args.max_minutes, processes=args.processes,
                          vision_share=args.vision_share, first_item=args.first_item, tiling=args.tiling,
                          init=None if args.init is None else Path(args.init), regions=args.regions,
                          freeze_vision=args.freeze_vision, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    # The run writes beside --out and moves its files in at the end (train()): that folder must
    # take files, and nothing is created before the run has anything to put there.
    check_writable([out.parent], [])
    try:
        report = train(cfg)
    except ValueError as e:  # an --init folder that cannot be continued, a run that diverged
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        print(f"vlmstream: train-tiny stopped: {out} left as it was", file=sys.stderr)
        raise
    print(json.dumps(report))
    return 0
