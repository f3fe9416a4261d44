"""Ctrl-C and SIGTERM in a training run of several processes: the main process alone takes them
and ends the others; its render workers and training processes are deaf to them from their first
instruction, and the final renames of a run happen whole or not at all.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what stops a run: Ctrl-C, `kill`, `timeout`, systemd


@contextmanager
def signals_held():
    """Ctrl-C and SIGTERM wait until the block is done; the run it ends is then complete, and
    ends as such. Between two renames, one had left a new tokenizer and config beside the old
    weights, and the command said the folder was left as it was."""
    import threading

    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
        yield
        return
    held = {sig: signal.signal(sig, lambda *_: None) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def deaf_to_stop_signals(*_) -> None:
    """Ctrl-C reaches every process of the terminal's foreground group, and a SIGTERM sent to the
    group (`timeout`, systemd's stop) every process of it: the render workers and the other
    training processes died of it, and PyTorch turned the main process's KeyboardInterrupt into
    "DataLoader worker exited unexpectedly" or "... killed by signal: Terminated" (exit 1,
    tracebacks). The main process alone takes them, and ends the others."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def render_worker_init(*_) -> None:
    """A render worker: deaf to Ctrl-C and SIGTERM (above), and quiet when its training process
    is gone. It hands each batch's tensors over through a listener thread (multiprocessing's
    resource sharer), which prints through sys.excepthook a peer that died during the handshake:
    a Ctrl-C that stopped the run cleanly once ended with that traceback under its one line.
    Its other errors reach the training process through the DataLoader, not this hook."""
    import sys
    from multiprocessing import AuthenticationError

    deaf_to_stop_signals()
    report = sys.excepthook

    def hook(kind, value, tb) -> None:
        if not issubclass(kind, (EOFError, ConnectionError, AuthenticationError)):
            report(kind, value, tb)

    sys.excepthook = hook


@contextmanager
def children_born_deaf(spawned: bool):
    """Processes started inside ignore Ctrl-C and SIGTERM from their first instruction: a spawned
    training process that got one while still importing torch (two seconds, more on a loaded
    machine) printed a KeyboardInterrupt traceback before `deaf_to_stop_signals` could run.
    spawned: started by exec, which keeps an ignored signal (Python then installs no handler of
    its own) but not a blocked mask; this process ignores them too meanwhile, the milliseconds
    that starting takes, so a Ctrl-C then is lost and a second one stops the run. Otherwise
    forked: the blocked mask of this thread is inherited until the child ignores the signals,
    and here another thread takes one meanwhile (ignoring Ctrl-C here had lost one that came
    as the render worker was forked, and the run trained on)."""
    import threading

    if not spawned:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
        yield
        return
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
