"""outlines-core's Index of a constraint, built in a child process that is killed past a time or
memory limit.

The states counted first (engine/char_dfa.py) catch the automata that grow exponentially in
the classic ways, but not every slow compile: classes outlines-core takes as Unicode (`.`,
`\\W`, `\\d`) under nested bounded repeats can make a pattern of a few dozen states take 20 s
and 800 MB, and random nested patterns ran past 8 s one time in thirteen. Built in this
process, such a compile held the submitting thread (a UI user's) for as long as it took,
memory growing, with no way to stop it; a child is stopped with its memory. It costs ~50 ms a
constraint (compiled once per engine and kept).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

TIMEOUT_S = 30.0  # a constraint that takes longer to compile is refused
MEMORY_BYTES = 4 << 30  # the child's address space
# Children compiling at once in this process; other compiles wait their turn. Every web UI page
# and API call submits in its own thread (Gradio runs up to 40 at once): 40 slow patterns sent
# together had been 40 children, each a core and up to MEMORY_BYTES for TIMEOUT_S.
MAX_CHILDREN = 2
_turns = threading.BoundedSemaphore(MAX_CHILDREN)


def _forked() -> None:
    # In a child forked while compiles ran: their threads did not come along to give their turns
    # back, and an Engine made there (as a fork's EngineClosedError asks) waited for ever on one.
    global _turns
    _turns = threading.BoundedSemaphore(MAX_CHILDREN)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)

_REFUSED = 3  # the child's exit status when outlines-core refuses the pattern

_CHILD = f"""
import pickle, resource, sys
try:
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
except (ValueError, OSError):  # a system that does not take it: time alone limits the child
    pass
from outlines_core import Index, Vocabulary
pattern, eos, vocab = pickle.load(sys.stdin.buffer)
try:
    index = Index(pattern, Vocabulary(eos, vocab))
except MemoryError:
    raise
except Exception as e:
    text = str(e).strip()
    sys.stderr.write((text.splitlines()[0] if text else type(e).__name__) + "\\n")
    sys.exit({_REFUSED})
pickle.dump((index.get_initial_state(), index.get_transitions(), index.get_final_states()), sys.stdout.buffer,
            protocol=pickle.HIGHEST_PROTOCOL)
"""


class CompileError(Exception):
    """Why the Index could not be built, in one line."""


def build(pattern: str, eos_id: int, vocabulary: dict[bytes, list[int]]) -> tuple[int, dict, set]:
    """(initial state, transitions {state: {token: state}}, final states) of outlines-core's
    Index; CompileError says why there is none (refused, too slow, too big). At most
    MAX_CHILDREN compile at once; a compile waits for its turn meanwhile."""
    with _turns:
        return _build(pattern, eos_id, vocabulary)


def _build(pattern: str, eos_id: int, vocabulary: dict[bytes, list[int]]) -> tuple[int, dict, set]:
    try:
        # -P: the working folder is not on its import path (a pickle.py there had been imported).
        proc = subprocess.Popen([sys.executable, "-P", "-c", _CHILD, str(MEMORY_BYTES)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except (OSError, ValueError) as e:  # no interpreter to run it (an embedded Python)
        raise CompileError(f"its compiler could not start: {e}") from None
    try:
        out, err = proc.communicate(pickle.dumps((pattern, eos_id, vocabulary)), timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CompileError(f"it took over {TIMEOUT_S:g} s to compile (simplify it: fewer nested or bounded "
                          "repeats of . or of wide classes)") from None
    except BaseException:  # an interrupt: the child goes too
        proc.kill()
        proc.communicate()
        raise
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    if proc.returncode == _REFUSED:
        raise CompileError(lines[-1] if lines else "outlines-core refused it")
    if proc.returncode != 0:
        if proc.returncode < 0 or any("MemoryError" in line or "memory allocation" in line for line in lines):
            raise CompileError(f"compiling it needs more than {MEMORY_BYTES / (1 << 30):.3g} GB of memory (simplify it)")
        raise CompileError(lines[-1] if lines else f"its compiler exited with status {proc.returncode}")
    return pickle.loads(out)
