"""The `vlmstream` console script. It imports nothing heavy itself, so that a Ctrl-C while torch
and the rest load (the first second or two of every command) ends as any other interruption
does: one line and exit code 130, not a traceback through torch's imports.

SIGTERM (kill, timeout, systemd or docker stopping a job) ends a command as Ctrl-C does, with
exit code 143: the outputs keep every result so far and are closed properly. Without it an
annotated MP4 was left without its index (unplayable) and a live log's last lines unwritten."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """Within the block a SIGTERM raises KeyboardInterrupt in the main thread, once (a second one
    while the outputs are being closed waits for them). Yields a list that holds the signal
    once it came. Elsewhere than the main thread (where signals cannot be caught) it does nothing."""
    got: list[int] = []

    def handler(signum, frame) -> None:
        if not got:
            if _after_torch_import(signum):
                return
            got.append(signum)
            _requested.append(signum)
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    previous = signal.signal(signal.SIGTERM, handler)
    # A hangup (the terminal closed, an ssh session dropped) killed the process as it stood: a
    # live recording's last second and the run's summary lost. It ends the run as SIGTERM does,
    # unless ignored (nohup), as it stays.
    hangup = getattr(signal, "SIGHUP", None)
    previous_hup = signal.getsignal(hangup) if hangup is not None else None
    if previous_hup is signal.SIG_DFL:
        signal.signal(hangup, handler)
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_hup is signal.SIG_DFL:
            signal.signal(hangup, previous_hup)
        if got:
            _requested.clear()  # answered: the block is over
        _interrupts.clear()


_requested: list[int] = []  # every SIGTERM taken by a block above, for stop_requested


def _torch_importing() -> bool:
    """Whether `import torch` runs (importlib marks the module's spec meanwhile)."""
    return bool(getattr(getattr(sys.modules.get("torch"), "__spec__", None), "_initializing", False))


def _after_torch_import(signum: int) -> bool:
    """Whether the signal waits for torch's import to end (then comes again). PyTorch's C++
    initialisation calls back into Python (pybind11): a KeyboardInterrupt raised there is not
    caught and aborts the process ("terminate called after throwing an instance of
    'pybind11::error_already_set'", SIGABRT), seen with a Ctrl-C 0.4-0.6 s into `import torch`
    (torch.distributed's _c10d_init)."""
    if not _torch_importing():
        return False
    if signum in _deferred:  # pressed again meanwhile: one comes after the import, as one was asked
        return True
    _deferred.add(signum)

    def again() -> None:
        deadline = time.monotonic() + 60  # never lost for good
        while _torch_importing() and time.monotonic() < deadline:
            time.sleep(0.01)
        _deferred.discard(signum)
        os.kill(os.getpid(), signum)

    threading.Thread(target=again, name="vlmstream-signal", daemon=True).start()
    return True


_deferred: set[int] = set()  # signals held until torch's import ends


def _interrupt(signum, frame) -> None:
    """Ctrl-C: KeyboardInterrupt, as Python's own handler, except while torch is being imported;
    kept for stop_requested(ctrl_c=True)."""
    if not _after_torch_import(signum):
        _interrupts.append(signum)
        raise KeyboardInterrupt


_interrupts: list[int] = []  # every Ctrl-C that _interrupt raised, until the block above ends


def stop_requested(ctrl_c: bool = False) -> bool:
    """Whether a SIGTERM came within a `sigterm_as_interrupt` block. A long loop checks it at each
    turn: the KeyboardInterrupt raised at an unlucky moment can be lost (raised inside a finalizer,
    which Python reports and ignores), and a `kill` of train-tiny was once left training.
    ctrl_c: a Ctrl-C too, for a loop that nothing should outlast. Its KeyboardInterrupt is lost
    as easily: train-tiny's optimizer imports torch._dynamo, then sympy and mpmath, whose
    `import gmpy2` sits in a bare `except: pass`; a Ctrl-C taken in that import's search of
    sys.path vanished, and the run trained on. Not for loops that finish their work after a first
    Ctrl-C (live's frames in flight): the one it raised would end them at once."""
    return bool(_requested) or (ctrl_c and bool(_interrupts))


def stopped_code(term: list[int]) -> int:
    """The exit code of a run stopped by Ctrl-C (130), SIGTERM (143) or SIGHUP (129), as shells
    report them."""
    return 128 + (term[0] if term else signal.SIGINT)


def entry() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored (started in the background)
        signal.signal(signal.SIGINT, _interrupt)
    with sigterm_as_interrupt() as term:
        try:
            from app.cli import main
        except KeyboardInterrupt:
            print("vlmstream: " + ("terminated" if term else "interrupted"), file=sys.stderr)
            sys.exit(stopped_code(term))
    code = main()
    # Done, its outputs closed: a signal in the interpreter's exit (torch's teardown, ~0.4 s) can
    # stop nothing. It had killed the process (exit -2 or -15 for a finished run), or printed a
    # KeyboardInterrupt traceback from an atexit callback and exited 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.exit(code)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Ask glibc malloc to reuse freed blocks instead of handing them back to the kernel.

    With the default thresholds, multi-megabyte activations (the vision encoder's) may be mmapped
    and unmapped on every forward, and each reuse page-faults its memory in again: measured here,
    that doubles the encoder's time on CPU, erratically (it depends on the allocator's history).
    Process-wide, so it is called at the edge (the CLI), not by the engine. Returns False where
    the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def one_opencv_thread() -> None:
    """OpenCV's work per frame (scene cuts' thumbnails, a page's outline) on the calling thread.

    Its thread pool spent ~40 % more CPU on a 640x360 frame's grey thumbnail than the calling
    thread alone (252 vs 181 us), on the cores the model's threads need: `video` on two cores
    took 3 % less CPU without it, with the same cuts. Process-wide, so called at the edge (the CLI).
    """
    import cv2

    cv2.setNumThreads(1)
