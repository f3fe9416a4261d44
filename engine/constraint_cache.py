"""Compiled constraints kept for reuse: many frames ask the same thing, and a compile can take
seconds (outlines-core over the vocabulary, in a child process with a time and memory bound).

The cache is bounded by the automata's bytes, least recently used dropped first (choices that
change with every frame had kept every table: 12 MB each at Moondream 2's vocabulary); a request
holds its own automaton, evicted or not. A constraint that cannot compile is remembered with
why, so a retry is refused at once instead of waiting out the same compile again. Thread-safe:
every submitting thread compiles through it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .constraints import Choice, ConstraintError, compile_constraint

CONSTRAINT_CACHE_BYTES = 256 << 20  # compiled constraints kept, least recently used dropped first
REFUSED_KEPT = 256  # constraints that could not compile, kept with why


class ConstraintCache:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_id: int, device: Any):
        self._compile_args = (tokenizer, vocab_size, eos_id, device)
        self._lock = threading.Lock()
        self._automata: OrderedDict = OrderedDict()  # least recently used first
        self._refused: OrderedDict = OrderedDict()  # why each could not compile, oldest first

    def get(self, constraint: Any):
        """The constraint's automaton, compiled now or earlier; ConstraintError where it cannot be."""
        try:
            hash(constraint)
        except TypeError:  # a dict or list given as the constraint, or a Choice holding a list
            if isinstance(constraint, Choice):
                raise ConstraintError("Choice needs a non-empty list of non-empty strings") from None
            raise ConstraintError(f"a constraint is a Regex, Choice or JsonSchema, got a {type(constraint).__name__}"
                                  ) from None
        with self._lock:
            automaton = self._automata.get(constraint)
            if automaton is not None:
                self._automata.move_to_end(constraint)
            refused = self._refused.get(constraint)
        if refused is not None:  # said once: a retry had waited out the same 30 s compile again
            raise ConstraintError(refused)
        if automaton is None:
            try:
                automaton = compile_constraint(constraint, *self._compile_args)
            except ConstraintError as e:
                with self._lock:
                    self._refused[constraint] = str(e)
                    while len(self._refused) > REFUSED_KEPT:
                        self._refused.popitem(last=False)
                raise
            with self._lock:
                self._automata[constraint] = automaton
                held = sum(a.nbytes for a in self._automata.values())
                while held > CONSTRAINT_CACHE_BYTES and len(self._automata) > 1:
                    held -= self._automata.popitem(last=False)[1].nbytes
        return automaton

    def __contains__(self, constraint: Any) -> bool:
        with self._lock:
            return constraint in self._automata

    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._automata.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._automata)
