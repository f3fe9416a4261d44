"""Standard input and named pipes as live sources: a program's stream piped in (`live -`,
`live /path/to/fifo`), read once, as it is written. Every wait on a pipe is bounded by a
timeout and ends when its consumer is gone, which FFmpeg's own pipe reading could not do.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Callable

from .connection import TIMED_OUT
from .frame import SourceError, SourceSilent

STDIN = "-"  # the live source name of standard input: a stream piped in
POLL_S = 0.1  # how often a read of standard input that waits looks whether its consumer is gone
PIPE_PROBE = {"probesize": "32768", "analyzeduration": "500000"}  # what a pipe is probed for before its first frame


def is_named_pipe(source: str) -> bool:
    """A named pipe by its path (mkfifo, /dev/stdin fed by a pipe, a shell's <(...)): read as
    standard input is, once, by `live`."""
    try:
        return source != STDIN and "://" not in source and Path(source).is_fifo()
    except (OSError, ValueError):  # a name too long, a NUL in it: no pipe (FileSource says why)
        return False


def open_pipe(path: str, display: str) -> int:
    """A named pipe's descriptor, opened without waiting for a writer (a plain open would, out of
    reach of every timeout and of Ctrl-C's clean stop)."""
    import os

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise SourceError(f"cannot read {display}: {e.strerror}") from None
    os.set_blocking(fd, True)  # reads come after select() says there is data
    return fd


def readable_within(fd: int, timeout: float, stopped: Callable[[], bool]) -> bool:
    """Whether `fd` has data (or its end) within `timeout` seconds; looked at every POLL_S, and
    False at once when `stopped()`."""
    import select

    deadline = time.monotonic() + timeout
    while not stopped():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if select.select([fd], [], [], min(POLL_S, left))[0]:
            return True
    return False


def wait_for_input(fd: int, timeout: float, stopped: Callable[[], bool] = lambda: False,
                   name: str = "standard input") -> None:
    """Wait until a pipe has data; a SourceError if none comes within `timeout` seconds, or if it
    ends first. A program piped into `live -` may take seconds to start its camera, but one that
    never sends anything (`sleep 80 | vlmstream live -`) kept the run waiting until it exited,
    and a pipe closed at once (`true | ...`) was called "Invalid data"."""
    import fcntl
    import struct
    import termios

    if not readable_within(fd, timeout, stopped):
        if stopped():  # a consumer gone (--duration) ends the wait
            return
        # a camera's program still starting, as a silent stream (exit 1), not a pipe that broke (exit 2)
        raise SourceSilent(f"cannot read {name}: nothing came for {timeout:g} s")
    try:
        waiting = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:  # not a pipe (a file redirected in): FFmpeg reads it as it is
        return
    if waiting == 0:  # readable with nothing to read: the writer closed it
        raise SourceError(f"cannot read {name}: it ended before any data came")


class PipeReader(io.RawIOBase):
    """Standard input as PyAV reads it. FFmpeg's own pipe read blocks in read(2), out of reach of
    its timeouts: a program piped in that stalled (its camera hung) kept `live -` waiting for
    ever, and a run's --duration could not end it. Here each read waits for data at most
    `timeout` seconds (then a TimeoutError), and reads as the end once `stopped()` (the consumer
    is gone)."""

    def __init__(self, fd: int, timeout: float, stopped: Callable[[], bool]):
        super().__init__()
        self._fd, self._timeout, self._stopped = fd, timeout, stopped

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        import os

        if readable_within(self._fd, self._timeout, self._stopped):
            data = os.read(self._fd, len(buffer))  # what the pipe holds, at once; b"" at its end
            buffer[: len(data)] = data
            return len(data)
        if self._stopped():
            return 0
        raise TimeoutError(f"{TIMED_OUT} {self._timeout:.1f} s")
