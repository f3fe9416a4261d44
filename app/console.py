"""Standard output and standard error as a command writes them (`guarded_console`).

Standard output holds results: one that cannot be written (a redirect onto a full disk) raises
`StandardOutputError`, which `vlmstream` says in one line with exit code 1. It had been a
traceback, one per frame in `live`, or a finished evaluation lost to one. A closed pipe stays a
BrokenPipeError (`head` has had enough: the commands stop quietly).

Standard error holds progress bars and messages, not results: one that cannot be written is
given up. A progress bar that failed to draw had held tqdm's lock for ever, and
`vlmstream video ... 2>>job.log` on a full disk hung at exit with nothing written.

A stream whose descriptor was closed when vlmstream started (`>&-`, `2>&-`, a service manager's
closed descriptors) is None in Python: it is a stream every write to fails (`_Closed`), as `cat`
and `ls` say "Bad file descriptor". The first progress bar had been an AttributeError traceback,
and a closed standard error lost the results of `video -o OUT.jsonl` (nothing written, exit 1).
"""

from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager
from typing import Iterator


class StandardOutputError(OSError):
    """Standard output could not be written (not a closed pipe: that is BrokenPipeError)."""


class _Closed:
    """A standard stream whose descriptor is closed (Python's None): writing fails with EBADF."""

    encoding = "utf-8"
    closed = False  # to whoever asks before writing: the failure is the write's

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def flush(self) -> None:  # nothing was written
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))


class _Guarded:
    def __init__(self, stream, results: bool):
        self._stream, self._results = stream if stream is not None else _Closed(), results
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
    saved = sys.stdout, sys.stderr  # None for a closed one, as Python had them
    out, err = _Guarded(sys.stdout, True), _Guarded(sys.stderr, False)
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
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
