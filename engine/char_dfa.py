"""The size of a pattern's character-level DFA, counted up to a limit before anything is built.

outlines-core turns a constraint's regex into a DFA with no bound on its size, then walks every
token of the vocabulary from every state. Some short patterns have exponentially many states:
`(a|b)*a(a|b){18}` has 2^19, and compiling it took 32 s and 1.3 GB on one submit for the tiny
model's vocabulary (a UI user can type it). Here the DFA is counted by subset construction over
Python's parse of the pattern, and the count stops at the limit, so a refusal costs about what
the limit allows. Two DFAs are counted: the anchored one outlines-core walks, and the one that
searches for the pattern anywhere in a text, which its regex library builds beside it and which
can be exponentially larger (`[A-Z].{0,100}[.!?]`). Both follow that library's leftmost-first
priorities, under which a match ends the threads below it.

The count is an estimate where Python's syntax and outlines-core's differ: classes such as \\d or
\\w are taken as ASCII, case-insensitive matching and look-around are ignored. Patterns Python
cannot parse (outlines-core's own syntax) are not counted: `states` returns None.
"""

from __future__ import annotations

import re
from functools import lru_cache
from re import _parser
from re._constants import MAXREPEAT

LAST = 0x10FFFF  # the last code point
NFA_LIMIT = 400_000  # NFA states built at most before a pattern is called too large
WORK_LIMIT = 5_000_000  # NFA nodes and moves visited at most (about a second)


class _TooLarge(Exception):
    pass


class _Unsupported(Exception):
    pass


class _Costly(Exception):
    """The closures' budget (WORK_LIMIT) is spent before the count ends."""


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
    def __init__(self, cap: int | None = None) -> None:
        self.cap = cap  # bounded repeats cut to at most this many rounds
        self.cut = 0  # the most rounds of a repeat that was cut (0: none was)
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
        if self.cap is not None and (low > self.cap or high is not MAXREPEAT and high > self.cap):
            self.cut = max(self.cut, low if high is MAXREPEAT else high)
            low = min(low, self.cap)
            high = high if high is MAXREPEAT else min(high, self.cap)
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


@lru_cache(maxsize=16)  # one compile reads the same pattern's parse four times
def parse(pattern: str):
    """Python's parse of a pattern (read, never changed), or None where its syntax is
    outlines-core's alone."""
    try:
        return _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None


def states(pattern: str, limit: int, search: bool = False) -> int | None:
    """The number of states of the pattern's DFA over characters, or limit + 1 once it has more
    than `limit`; None where Python cannot parse the pattern, or where counting would take more
    than about a second (big sets of NFA nodes in few states: `(a?){1000}` has 1001).
    search: the DFA that finds the pattern anywhere in a text (a lazy `.*?` before it), which
    outlines-core's regex library builds too, and which can grow exponentially where the anchored
    one does not: `A.{0,16}\\.` has 35 states anchored, over 2^16 searching (2.2 s to compile)."""
    return _states(pattern, limit, search, None)[0]


def search_doubles(pattern: str, limit: int) -> bool:
    """Whether the search DFA doubles with each round of a bounded repeat and so, at the repeat's
    full length, has more than `limit` states: told by counting it with the repeats cut to 8
    rounds and to 10 (4 times as many at 10, where a Choice of many words or a long JSON array
    grows by a fifth), then doubling that for each round past 10 of the longest repeat cut.
    `[A-Z].{0,100}[.!?]` doubles (528 states at 8, 2056 at 10: ~2^100 at 100, a compile that
    never ends); counted whole, its sets of 100 threads run out of time. `a[a-z]{13}` doubles
    too but stays at 8193."""
    large, longest = _states(pattern, 1 << 16, True, 10)
    if not longest or large is None or large < 1 << 10:
        return False
    small = _states(pattern, 1 << 16, True, 8)[0]
    return small is not None and large >= 3.5 * small and large << (longest - 10) > limit


def _states(pattern: str, limit: int, search: bool, cap: int | None) -> tuple[int | None, int]:
    """states(), with the bounded repeats cut to at most `cap` rounds; and the most rounds of a
    repeat the cap cut (0: none)."""
    tree = parse(pattern)
    if tree is None:
        return None, 0
    nfa = _NFA(cap)
    try:
        start, accept = nfa.seq(tree)
        loop = None
        if search:
            loop = nfa.node()
            nfa.moves[loop].append((((0, LAST),), loop))
        return _Subsets(nfa, start, accept, loop).count(limit), nfa.cut
    except _TooLarge:
        return limit + 1, nfa.cut
    except (_Costly, _Unsupported, RecursionError):
        return None, nfa.cut


class _Subsets:
    """Subset construction with leftmost-first priorities, as the regex library under
    outlines-core determinizes: a DFA state is the ordered tuple of NFA nodes alive, highest
    priority first (kept to those with moves, and the accepting one); a match drops every thread
    below it. Without that cut, `(yes|no): .{1,100}` counted 2^100 search states where the
    library builds a few hundred: once a match is found it starts no new thread."""

    def __init__(self, nfa: _NFA, start: int, accept: int, loop: int | None) -> None:
        self.eps, self.moves, self.start, self.accept, self.loop = nfa.eps, nfa.moves, start, accept, loop
        self.work = 0
        self._closures: dict[int, tuple[int, ...]] = {}

    def spend(self, n: int) -> None:
        self.work += n
        if self.work > WORK_LIMIT:
            raise _Costly

    def _node_closure(self, node: int) -> tuple[int, ...]:
        """The nodes reached from `node` without a character, in priority order (depth first,
        each node's epsilon edges in the order built: the first branch, a greedy repeat's
        next round before its exit)."""
        found = self._closures.get(node)
        if found is None:
            eps, moves, out, seen, stack = self.eps, self.moves, [], set(), [node]
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                if moves[n] or n == self.accept:
                    out.append(n)
                stack.extend(reversed(eps[n]))
            self.spend(len(seen))
            found = self._closures[node] = tuple(out)
        return found

    def closure(self, nodes) -> tuple[int, ...]:
        out, seen = [], set()
        for node in nodes:
            # The search loop is the lowest priority: a new thread starts here, then the loop goes on.
            for n in (self._node_closure(self.start) + (node,) if node == self.loop else self._node_closure(node)):
                if n not in seen:
                    seen.add(n)
                    out.append(n)
                    if n == self.accept:  # leftmost-first: nothing below a match
                        self.spend(len(out))
                        return tuple(out)
        self.spend(len(out))
        return tuple(out)

    def count(self, limit: int) -> int:
        first = self.closure([self.start] if self.loop is None else [self.loop])
        known, todo = {first}, [first]
        while todo:
            here = todo.pop()
            moves = [target for n in here for _, target in self.moves[n]]
            # Sweep the code points: at each boundary the moves that apply change; they keep
            # their priority order (their index). A class of 3000 single characters is 6000
            # boundaries, each with a move or none. A move's intervals are merged (_merged,
            # _complement): never overlapping nor touching, so one starts where none ends.
            events: dict[int, list[tuple[int, bool]]] = {}
            i = 0
            for n in here:
                for intervals, _ in self.moves[n]:
                    for lo, hi in intervals:
                        events.setdefault(lo, []).append((i, True))
                        events.setdefault(hi + 1, []).append((i, False))
                    i += 1
            active: set[int] = set()
            swept: set[tuple[int, ...]] = set()  # a class of single characters gives the same set thousands of times
            for point in sorted(events):
                for index, starts in events[point]:
                    if starts:
                        active.add(index)
                    else:
                        active.discard(index)
                self.spend(len(events[point]) + len(active))
                key = tuple(sorted(active))
                if not key or key in swept:
                    continue
                swept.add(key)
                nxt = self.closure([moves[index] for index in key])
                if nxt not in known:
                    known.add(nxt)
                    if len(known) > limit:
                        return limit + 1
                    todo.append(nxt)
        return len(known)
