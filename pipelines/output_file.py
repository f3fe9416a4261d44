"""An output file a run writes: opened once no other run writes it, and cut back to its last
whole line before a run appends to it.

Each run holds an exclusive lock (flock) on the outputs it writes, from their open to their
close; a second run into the same file is refused (`OutputBusy`) instead of writing over the
first's lines. On a file system without locks, outputs are written as before.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import VlmstreamError


def cut_partial_line(path: str | Path) -> None:
    """Cut a file of lines back to its last whole one: a last line a kill or a full disk left
    without its newline, appended to, joins the next run's first into one that is no JSON.
    Truncated in place: the file was rewritten, and a rewrite that failed (the disk full again)
    lost every line. Anything but a regular file is left alone."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        end = pos = f.seek(0, os.SEEK_END)
        while pos > 0:
            step = min(pos, 1 << 16)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            if pos + step == end and chunk.endswith(b"\n"):
                return
            i = chunk.rfind(b"\n")
            if i >= 0:
                f.truncate(pos + i + 1)
                return
        f.truncate(0)


def name_write_error(error: OSError, path: str | Path | None) -> None:
    """Name the output in a write error (one from an open file names none): unnamed, `video` said
    "cannot write its results", and a subtitle file's failure twice (again, by name, at close)."""
    if error.filename is None and path is not None:
        error.filename = str(path)


class OutputBusy(VlmstreamError, OSError):
    """An output another process is writing now (it holds the file's lock, `open_output`)."""

    def __init__(self, path: str | Path):
        super().__init__(f"{path} is being written by another vlmstream run: wait for it to end, or write elsewhere")


def open_output(path: str | Path, mode: str):
    """An output file opened to write ("w", "a", "w+b" unbuffered), once no other process writes
    it: each run holds an exclusive lock on its outputs (flock; not on a file system without locks).
    Two runs into one JSONL or folder had each cut the file at its start and written over the
    other's lines: lines lost and spliced into ones that were no JSON, and both said done. The file
    is emptied ("w") only once it is ours; OutputBusy otherwise."""
    flags = (os.O_RDWR if "+" in mode else os.O_WRONLY) | os.O_CREAT | (os.O_APPEND if mode == "a" else 0)
    # the path's own name kept (PyAV picks an MP4's format by it); opened without O_TRUNC
    f = open(path, mode, **({"buffering": 0} if "b" in mode else {"encoding": "utf-8"}),
             opener=lambda name, _: os.open(name, flags, 0o666))
    try:
        if output_busy(f.fileno()):
            raise OutputBusy(path)
        if mode != "a" and stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # (a device, /dev/full, is not cut)
            f.truncate(0)
    except BaseException:
        f.close()
        raise
    return f


def output_busy(fd: int) -> bool:
    """Whether another open file holds the lock on this file; takes the lock if not (it goes with
    the file's close)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except (ImportError, OSError):  # Windows; a file system without locks (ENOLCK): written as before
        pass
    return False
