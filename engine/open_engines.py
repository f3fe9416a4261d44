"""The engines open in this process, and what the process's end and its forks do to them.

At exit, an engine left open is closed with its requests cancelled and its threads joined
(`close_at_exit`). In a child forked after an engine started, none of the engine's threads run:
it refuses new work with EngineClosedError naming the fork, and the requests it had not finished
end "error" there (`forked`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine

open_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()

EXIT_QUIET_S = 5.0  # at exit, the wait for an engine's steps before it is said
EXIT_WAIT_S = 600.0  # and the longest wait: a device that hangs


@atexit.register
def close_at_exit() -> None:
    """A program that ends without close(): its requests are cancelled and the engine's threads
    joined before the interpreter goes down under them (a TorchScript call still running then had
    aborted the process: "terminate called without an active exception", exit 134). A slow
    model's step (Moondream 2 in fp32 on a CPU: over a minute) had outlasted a 30 s wait."""
    for engine in list(open_engines):
        try:
            engine.close(cancel=True, timeout=EXIT_QUIET_S)
        except TimeoutError:
            print("vlmstream: waiting for the engine's current step to end", file=sys.stderr, flush=True)
            try:
                engine.close(cancel=True, timeout=EXIT_WAIT_S)
            except Exception:  # stuck: nothing more to do at exit
                pass
        except Exception:  # a failed engine: nothing more to do at exit
            pass


def forked() -> None:
    """In a child process forked from this one (os.fork, multiprocessing's "fork", a preforking
    server's workers after a preload): the engines' threads did not come along. A submit to one
    had been taken and never answered, result() waiting for ever; it is an EngineClosedError."""
    parent = os.getppid()
    for engine in list(open_engines):
        unread = engine._inbox.forked(f"the engine was created in process {parent}, and this process is a fork of "
                                      "it, where the engine's threads do not run: create the Engine in this process")
        engine._shut = True  # nothing to join here: close() and the exit's close return at once
        # Requests submitted before the fork and unfinished at it are never answered here: they
        # end "error" (their result() had waited for ever), as a failed engine's do.
        # By its handle, not `finalized`: the engine thread marks a request finalized before it
        # makes its output and finishes the handle (Batch.finalize), and a fork in between left
        # that one waiting for ever.
        now = time.perf_counter()
        for seq in [*(s for s in list(engine._batch.seqs.values()) if not s.handle.done()), *unread]:
            seq.finalized, seq.finish_reason = True, "error"
            seq.handle._end_in_fork(seq.output("error", now))
    open_engines.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forked)
