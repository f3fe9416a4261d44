"""The `vlmstream` console script. It imports nothing heavy itself, so that a Ctrl-C while torch
and the rest load (the first second or two of every command) ends as any other interruption
does: one line and exit code 130, not a traceback through torch's imports."""

from __future__ import annotations

import sys


def entry() -> None:
    try:
        from app.cli import main
    except KeyboardInterrupt:
        print("vlmstream: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
