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
    from engine.models.loader import TINY_DIR

    kw = {} if args.out is None else {"out": Path(args.out)}
    init = None if args.init is None else TINY_DIR if args.init == "tiny" else Path(args.init)  # as --model says it
    try:
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                          threads=args.threads, max_minutes=args.max_minutes, processes=args.processes,
                          vision_share=args.vision_share, first_item=args.first_item, tiling=args.tiling,
                          init=init, regions=args.regions, freeze_vision=args.freeze_vision, **kw)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = Path(cfg.out)
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file, not a folder")
        # The run writes into a folder of its own in --out and moves its files in at the end
        # (train()): the nearest folder that exists must take files; nothing is created yet.
        nearest = next(p for p in (out, *out.parents) if p.exists())
        if not nearest.is_dir():  # it said "cannot create the output folder ...: File exists"
            raise UsageError(f"--out {out}: {nearest} is a file, not a folder")
        check_writable([nearest], [])
    except OSError as e:  # a name too long for the file system
        raise UsageError(f"--out {out}: {e.strerror or e}") from None
    shipped = " (the shipped tiny model, --model tiny)" if out.resolve() == TINY_DIR.resolve() else ""
    if shipped:  # the default: said before the run, not 85 minutes later
        print(f"vlmstream: train-tiny replaces {out}{shipped} when the run ends (--out DIR to keep it)",
              file=sys.stderr)
    try:
        report = train(cfg)
    except ValueError as e:  # an --init folder that cannot be continued, a run that diverged
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:  # said once, by the command line's own line ("interrupted: ...")
        raise KeyboardInterrupt(f"train-tiny stopped, {out} left as it was") from None
    except OSError as e:  # the disk filled (at the end, the weights): said, not a traceback
        print(f"vlmstream: error: train-tiny could not write into {out}: {e.strerror or e}; {out} left as it was",
              file=sys.stderr)
        return 1
    print(json.dumps(report))
    print(f"vlmstream: train-tiny wrote {out}{shipped}", file=sys.stderr)
    return 0
