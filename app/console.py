"""Standard output and standard error as a command writes them (`guarded_console`).

Standard output holds results: one that cannot be written (a redirect onto a full disk) raises
`StandardOutputError`, which `vlmstream` says in one line with exit code 1. It had been a
traceback, one per frame in `live`, or a finished evaluation lost to one. A closed pipe stays a
BrokenPipeError (`head` has had enough: the commands stop quietly).

Standard error holds progress bars and messages, not results: one that cannot be written is
given up. A progress bar that failed to draw had held tqdm's lock for ever, and
`vlmstream video ... 2>>job.log` on a full disk hung at exit with nothing written.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


class StandardOutputError(OSError):
    """Standard output could not be written (not a closed pipe: that is BrokenPipeError)."""


class _Guarded:
    def __init__(self, stream, results: bool):
        self._stream, self._results = stream, results
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._fail(e)
            return len(text)
        except UnicodeEncodeError:  # a file name's undecodable bytes, on a stream that takes none
            return self.write(text.encode(self._stream.encoding or "utf-8", "backslashreplace").decode(
                self._stream.encoding or "utf-8"))

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if self._results and isinstance(e, BrokenPipeError):
            raise e
        self.failed = self.failed or e
        if self._results:
            raise StandardOutputError(e.errno, e.strerror or str(e)) from e

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def guarded_console() -> Iterator[None]:
    """Within the block sys.stdout and sys.stderr are guarded as the module says. A stream that
    failed is pointed at /dev/null after it, so that the exit's flush of what it still holds does
    not print "Exception ignored" with the same error."""
    out, err = _Guarded(sys.stdout, True), _Guarded(sys.stderr, False)
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out._stream, err._stream
        for guarded in (out, err):
            if guarded.failed is not None and not isinstance(guarded.failed, BrokenPipeError):
                _to_devnull(guarded._stream)


def _to_devnull(stream) -> None:
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # not a file (a test's capture)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
