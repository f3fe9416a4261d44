"""Flags and pieces that several of `vlmstream`'s commands share (app/parser.py builds each command).

`Once`: an option given twice is a mistake; `lazy`: a command's `func`, its module imported only
when it runs; the `add_*_args` helpers: a group of flags with the same meaning (and help) in
every command that takes it (model and device, sticky answers, --changes, how frames are read).
"""

from __future__ import annotations

import argparse

from pipelines.live import LIVE_STICKY


class Once(argparse.Action):
    """Stores like `store`, but a second value is a mistake: argparse kept the last one, so
    `image --question A --question B` answered B alone, without a word (a second --choices was
    already refused; `video` and `live` ask every --question)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            more = " (video and live ask several --question)" if self.dest in ("caption", "question") else ""
            raise argparse.ArgumentError(self, f"given twice; it takes one{more}")
        setattr(namespace, self.dest, values)


def lazy(module: str):
    """A command implemented in its own module, imported only when that command runs."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).run(args)

    return run


def add_changes_args(p: argparse.ArgumentParser, what: str, frames: str, where: str) -> None:
    """--changes, --hold and --snapshots of `video` and `live` (checked by `check_changes_args`)."""
    p.add_argument("--changes", action="store_true",
                   help=what + " (the same things named in another order are the same answer)")
    p.add_argument("--hold", type=int, default=None, metavar="N",
                   help=f"with --changes, a new answer counts once N {frames} in a row gave it (default 1)")
    p.add_argument("--snapshots", metavar="FOLDER",
                   help=f"with --changes, save the frame of each change there as a JPEG (its path in the {where})")


def add_sticky_arg(p: argparse.ArgumentParser, kept: str) -> None:
    p.add_argument("--sticky", type=float, default=None, metavar="M",
                   help=f"keep {kept}, token by token, unless the model rates another token more than M logits "
                        f"higher (default {LIVE_STICKY:g}: captions change when the frame does, not frame to frame; "
                        "0: each frame's plain greedy answer; after a scene cut a frame is asked afresh)")


def add_vision_thread_arg(p: argparse.ArgumentParser, what: str, why: str) -> None:
    p.add_argument("--no-vision-thread", action="store_true",
                   help=f"CPU: encode {what} in the device thread's steps instead of a thread of their own ({why})")


def add_reading_args(p: argparse.ArgumentParser) -> None:
    """--no-deinterlace and --no-tonemap (read by `reading_arg`): frames as stored, not as shown."""
    p.add_argument("--no-deinterlace", action="store_true",
                   help="read frames flagged interlaced as stored, their two fields woven (default: made whole, "
                        "as a player shows them); for progressive video flagged interlaced (PsF masters)")
    p.add_argument("--no-tonemap", action="store_true",
                   help="read HDR video (HLG, PQ) as if SDR (default: tone-mapped to SDR BT.709, as a player "
                        "shows it); for SDR video tagged HDR by mistake, which tone-mapping makes dim and flat")


NATIVE_BF16 = "bfloat16 on cuda and on CPUs with bf16 matrix instructions (AVX512-BF16, AMX), else float32"


def add_model_args(p: argparse.ArgumentParser, default: str = "float32 on cpu, bfloat16 on cuda",
                    random: bool = False) -> None:
    """--model, --device, and --dtype with `default` as the help's account of what no --dtype means.
    random: the model may also be a layout with random weights (bench)."""
    if random:
        p.add_argument("--model", default="tiny", metavar="tiny|DIR|random:LAYOUT",
                       help="'tiny', a local Moondream 2 folder, or random:moondream2 / random:tiny (that "
                            "layout with random weights; default: tiny)")
    else:
        p.add_argument("--model", default="tiny", metavar="tiny|DIR",
                       help="'tiny' (embedded default) or a local Moondream 2 folder (default: tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help=f"weights and activations (default: {default})")
