"""`vlmstream` command line: `main` parses the arguments (`app.parser`) and runs the command.

    vlmstream image | video | live | ui | bench | train-tiny | eval-tiny ... (`vlmstream COMMAND --help`)

User mistakes print one line `vlmstream: error: ...` on stderr and exit with code 2; Ctrl-C and
SIGTERM one line and 130 or 143. The checks of argument values that several commands share live
here too.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from app.console import StandardOutputError, guarded_console
from app.errors import UsageError
from app.launcher import keep_freed_memory, one_opencv_thread, sigterm_as_interrupt, stopped_code
from app.parser import EXIT_USAGE, build_parser
from pipelines.live import LIVE_STICKY
from engine.errors import VlmstreamError, shortened

__all__ = ["UsageError", "main"]  # UsageError: the commands raise it from here


def sticky_arg(args: argparse.Namespace) -> float:
    """--sticky's margin (the default when not given); a usage error unless a number >= 0."""
    sticky = LIVE_STICKY if args.sticky is None else args.sticky
    if not 0 <= sticky < float("inf"):  # also NaN
        raise UsageError("--sticky must be a number >= 0")
    return sticky


def reading_arg(args: argparse.Namespace):
    """The sources' `Reading` from --no-deinterlace and --no-tonemap."""
    from pipelines.frame import Reading

    return Reading(deinterlace=not args.no_deinterlace, tonemap=not args.no_tonemap)


def check_changes_args(args: argparse.Namespace) -> None:
    if args.hold is not None and (not args.changes or args.hold < 1):
        raise UsageError("--hold N goes with --changes, N >= 1")
    if args.snapshots and not args.changes:
        raise UsageError("--snapshots goes with --changes (a picture of each change)")


def realtime_dtype(device: str, dtype: str | None) -> str | None:
    """The dtype of the real-time commands (live, video, ui) when none is given: bf16 on a CPU that
    computes it natively. There it runs the tiny model ~1.5x faster with the same held-out accuracy
    (EVAL.md) and the same batch invariance (pipelined == blocking == reference); elsewhere the
    engine's default (fp32 on CPU). `bench` and `eval-tiny` keep fp32 on CPU, as `image` does but for
    a folder stored in bf16 (`image_dtype`)."""
    if dtype is not None or not str(device).startswith("cpu"):
        return dtype
    from engine.device import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else None


def image_dtype(model: str, device: str, dtype: str | None) -> str | None:
    """`vlmstream image`'s dtype when none is given. A checkpoint stored in bf16 (Moondream 2's)
    runs as stored where the CPU computes bf16 natively: with the full-size layout on the AMX
    kind, 4-5x faster than fp32 and half the memory (BENCHMARKS.md). Others run in fp32 on CPU:
    the tiny model (stored in fp16; its held-out figures are fp32's, EVAL.md), and a train-tiny
    folder too, so that `image` answers as `eval-tiny` scored it (by its path, a copy of tiny ran
    in bf16)."""
    from engine.errors import VlmstreamError
    from engine.models.checkpoint import Checkpoint
    from engine.models.loader import RANDOM_PREFIX, resolve_model_dir

    if dtype is not None:
        return dtype
    if str(model).startswith(RANDOM_PREFIX):
        return realtime_dtype(device, dtype)
    try:
        with Checkpoint(resolve_model_dir(model) / "model.safetensors") as ckpt:
            stored_bf16 = any(ckpt.dtype_name(key) == "BF16" for key in ckpt.keys())
    except (VlmstreamError, OSError):
        return dtype  # the loader says what is wrong with the folder
    return realtime_dtype(device, dtype) if stored_bf16 else dtype


def print_report(report: dict, as_json: bool, table) -> None:
    """One JSON object on stdout with --json, else the human table."""
    if as_json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(table(report))


# Arguments that name an image, video, source, output, model or folder. Given empty (an unset
# shell variable), one must not quietly mean "none" or "this folder": `video ""` captioned every
# video under the working folder, `image --question ""` a caption.
_NAMES = {"image": "IMAGE", "files": "FILE", "sources": "SOURCE", "output": "-o", "annotate": "--annotate",
          "snapshots": "--snapshots", "model": "--model", "source": "--source", "out": "--out", "init": "--init",
          "device": "--device", "ssl_certfile": "--ssl-certfile", "ssl_keyfile": "--ssl-keyfile",
          "auth_file": "--auth-file"}


def folder_files(folder: Path, extensions: frozenset[str]) -> tuple[list[Path], list[str]]:
    """The files under `folder` with these extensions, and the subfolders that could not be listed
    (no read permission), each warned of: their files are missing, as an unreadable file's frames
    are (os.walk had dropped them without a word). A UsageError where `folder` itself cannot be
    read: it had said "no ... files in" it."""
    from pipelines.sources import files_under

    unlisted: list[OSError] = []
    found = files_under(folder, extensions, unlisted)
    for e in unlisted:
        if os.path.abspath(e.filename) == os.path.abspath(folder):
            raise UsageError(f"cannot read the folder {folder}: {e.strerror or e}")
        print(f"vlmstream: warning: skipped: cannot read the folder {e.filename}: {e.strerror or e}", file=sys.stderr)
    return found, [e.filename for e in unlisted]


def check_not_empty(args: argparse.Namespace) -> None:
    for dest, flag in _NAMES.items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not str(v).strip():
                raise UsageError(f"{flag} is empty")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the top parser, which would name its own help, not the command's
        parser.exit(EXIT_USAGE, f"vlmstream: error: unrecognized arguments: {' '.join(unknown)} "
                                f"(see vlmstream {args.command} --help)\n")
    keep_freed_memory()
    one_opencv_thread()
    # `kill`, `timeout`, systemd: ended as Ctrl-C ends it
    with sigterm_as_interrupt() as term, guarded_console():
        try:
            check_not_empty(args)
            code = args.func(args)
        except VlmstreamError as e:
            print(f"vlmstream: error: {e}", file=sys.stderr)
            return getattr(e, "exit_code", EXIT_USAGE)  # a stream given up for silence: 1 (SourceSilent)
        except StandardOutputError as e:  # a redirect onto a full disk: what was done is not all written
            print(f"vlmstream: error: cannot write standard output: {e.strerror}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:  # a command may say what it left ("train-tiny stopped, ...")
            said = f": {e.args[0]}" if e.args and isinstance(e.args[0], str) else ""
            print("vlmstream: " + ("terminated" if term else "interrupted") + said, file=sys.stderr)
            return stopped_code(term)
        except BrokenPipeError:  # e.g. piped into `head`
            return 0
        except OSError as e:
            if e.errno != errno.ENAMETOOLONG:
                raise
            # a source, model or output named past what the file system allows (asking whether
            # it exists raises): every command had a traceback for it
            name = os.fsdecode(e.filename) if e.filename is not None else ""
            print(f"vlmstream: error: a name too long for the file system ({len(os.fsencode(name))} bytes): "
                  f"{shortened(name)}", file=sys.stderr)
            return EXIT_USAGE
    # A command that finished its outputs after the signal says 130; the shell's code for SIGTERM is 143
    return stopped_code(term) if term and code == 130 else code


if __name__ == "__main__":
    sys.exit(main())
