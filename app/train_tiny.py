"""`vlmstream train-tiny`: see `vlmstream train-tiny --help` and EVAL.md."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from app.cli import UsageError


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
    try:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the output folder {cfg.out}: {e.strerror or e}") from None
    if not os.access(cfg.out, os.W_OK):
        raise UsageError(f"cannot write into {cfg.out}: permission denied")
    try:
        report = train(cfg)
    except ValueError as e:  # an --init folder that cannot be continued
        raise UsageError(str(e)) from None
    print(json.dumps(report))
    return 0
