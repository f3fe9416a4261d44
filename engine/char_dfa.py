"""The size of a pattern's character-level DFA, counted up to a limit before anything is built.

outlines-core turns a constraint's regex into a DFA with no bound on its size, then walks every
token of the vocabulary from every state. Some short patterns have exponentially many states:
`(a|b)*a(a|b){18}` has 2^19, and compiling it took 32 s and 1.3 GB on one submit for the tiny
model's vocabulary (a UI user can type it). Here the DFA is counted by subset construction over
Python's parse of the pattern, and the count stops at the limit, so a refusal costs about what
the limit allows.

The count is an estimate where Python's syntax and outlines-core's differ: classes such as \\d or
\\w are taken as ASCII, case-insensitive matching and look-around are ignored. Patterns Python
cannot parse (outlines-core's own syntax) are not counted: `states` returns None.
"""

from __future__ import annotations

import re
from re import _parser
from re._constants import MAXREPEAT

LAST = 0x10FFFF  # the last code point
NFA_LIMIT = 400_000  # NFA states built at most before a pattern is called too large
WORK_LIMIT = 4_000_000  # NFA states visited by the closures at most (a second or two)


class _TooLarge(Exception):
    pass


class _Unsupported(Exception):
    pass


_CATEGORIES = {
    "CATEGORY_DIGIT": ((48, 57),),
    "CATEGORY_SPACE": ((9, 13), (32, 32)),
    "CATEGORY_WORD": ((48, 57), (65, 90), (95, 95), (97, 122)),
}


def _merged(intervals) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(intervals) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for lo, hi in _merged(intervals):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= LAST:
        out.append((nxt, LAST))
    return tuple(out)


def _category(name: str) -> tuple[tuple[int, int], ...]:
    negated = name.startswith("CATEGORY_NOT_")
    base = _CATEGORIES.get(name.replace("CATEGORY_NOT_", "CATEGORY_"))
    if base is None:  # a line-break category: taken as \n
        base = ((10, 10),)
    return _complement(base) if negated else base


class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.moves: list[list[tuple[tuple[tuple[int, int], ...], int]]] = []

    def node(self) -> int:
        if len(self.eps) >= NFA_LIMIT:
            raise _TooLarge
        self.eps.append([])
        self.moves.append([])
        return len(self.eps) - 1

    def chars(self, intervals) -> tuple[int, int]:
        s, e = self.node(), self.node()
        if intervals:
            self.moves[s].append((intervals, e))
        return s, e

    def seq(self, items) -> tuple[int, int]:
        start = end = self.node()
        for op, av in items:
            s, e = self.item(str(op), av)
            self.eps[end].append(s)
            end = e
        return start, end

    def item(self, op: str, av) -> tuple[int, int]:
        if op == "LITERAL":
            return self.chars(((av, av),))
        if op == "NOT_LITERAL":
            return self.chars(_complement(((av, av),)))
        if op == "ANY":
            return self.chars(((0, 9), (11, LAST)))
        if op == "IN":
            negate = any(str(o) == "NEGATE" for o, _ in av)
            parts: list[tuple[int, int]] = []
            for o, a in av:
                o = str(o)
                if o == "LITERAL":
                    parts.append((a, a))
                elif o == "RANGE":
                    parts.append(a)
                elif o == "CATEGORY":
                    parts.extend(_category(str(a)))
            return self.chars(_complement(parts) if negate else _merged(parts))
        if op == "BRANCH":
            s, e = self.node(), self.node()
            for alternative in av[1]:
                a, b = self.seq(alternative)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        if op == "SUBPATTERN":
            return self.seq(av[-1])
        if op == "ATOMIC_GROUP":
            return self.seq(av)
        if op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            return self.repeat(*av)
        if op in ("AT", "ASSERT", "ASSERT_NOT"):
            s = self.node()
            return s, s
        raise _Unsupported(op)  # back-references: outlines-core refuses them itself

    def repeat(self, low: int, high: int, sub) -> tuple[int, int]:
        start = end = self.node()
        for _ in range(low):
            a, b = self.seq(sub)
            self.eps[end].append(a)
            end = b
        if high is MAXREPEAT:
            hub = self.node()
            a, b = self.seq(sub)
            self.eps[end].append(hub)
            self.eps[hub].append(a)
            self.eps[b].append(hub)
            return start, hub
        last = self.node()
        for _ in range(high - low):
            a, b = self.seq(sub)
            self.eps[end] += [a, last]
            end = b
        self.eps[end].append(last)
        return start, last


def states(pattern: str, limit: int) -> int | None:
    """The number of states of the pattern's DFA over characters, or limit + 1 once it has more
    than `limit` (or its count would take more than a second or two); None where Python cannot
    parse the pattern."""
    try:
        tree = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None
    nfa = _NFA()
    try:
        start, accept = nfa.seq(tree)
        return _Subsets(nfa, accept).count(start, limit)
    except _TooLarge:
        return limit + 1
    except (_Unsupported, RecursionError):
        return None


class _Subsets:
    """Subset construction, counted: each DFA state is the set of NFA nodes it stands for."""

    def __init__(self, nfa: _NFA, accept: int) -> None:
        self.eps, self.moves, self.accept = nfa.eps, nfa.moves, accept
        self.work = 0

    def spend(self, n: int) -> None:
        self.work += n
        if self.work > WORK_LIMIT:
            raise _TooLarge

    def closure(self, nodes) -> frozenset[int]:
        eps = self.eps
        seen, stack = set(nodes), list(nodes)
        while stack:
            for m in eps[stack.pop()]:
                if m not in seen:
                    seen.add(m)
                    stack.append(m)
        self.spend(len(seen))
        # Nodes without moves change nothing ahead, but where the match may end does.
        return frozenset(n for n in seen if self.moves[n] or n == self.accept)

    def count(self, start: int, limit: int) -> int:
        first = self.closure([start])
        known, todo = {first}, [first]
        while todo:
            here = todo.pop()
            # Sweep the code points: at each boundary the set of moves that cover it changes.
            events: dict[int, list[tuple[int, int]]] = {}
            for n in here:
                for intervals, target in self.moves[n]:
                    for lo, hi in intervals:
                        events.setdefault(lo, []).append((target, 1))
                        events.setdefault(hi + 1, []).append((target, -1))
            self.spend(len(events))
            active: dict[int, int] = {}
            targets: set[frozenset[int]] = set()
            for point in sorted(events):
                for target, step in events[point]:
                    count = active.get(target, 0) + step
                    if count:
                        active[target] = count
                    else:
                        active.pop(target, None)
                if active:
                    targets.add(frozenset(active))
            for target_set in targets:
                nxt = self.closure(target_set)
                if nxt not in known:
                    known.add(nxt)
                    if len(known) > limit:
                        return limit + 1
                    todo.append(nxt)
        return len(known)
