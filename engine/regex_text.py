"""A constraint's pattern printed again for outlines-core, so that its answers match in Python too.

outlines-core reads a regex with Rust's syntax and Unicode 16 tables; answers are checked with
Python's `re` (by us, and by users, the README says "in Python's syntax"), which on Python 3.11
reads Unicode 14 and defines its classes otherwise: `\\d` let through digits Python 3.11 does not
know (U+1CCF0..), `\\w` combining marks and connectors Python's refuses, `\\S` the separators
\\x1c-\\x1f that Python counts as space. So the pattern outlines-core compiles is printed back from
Python's own parse, every class and shorthand spelt out as the code points both read alike:

- a shorthand in a class that allows (`\\d`, `[\\w-]`) becomes what both libraries put in it;
  in a class that forbids (`[^\\d]`) everything either might put in it, code points Python's
  Unicode leaves unassigned too (a later Unicode may make them digits or letters);
- `.` is every code point but a newline, as in both;
- for a string inside JSON (a schema's `pattern`), no class or `.` lets through a quote, a
  backslash or a control character, which would end or escape the JSON string instead of being
  part of it; such a character written as a literal is a `ValueError`.

Answers are then a subset of what each library allows. Patterns Python cannot parse, or that use
what Rust's regex lacks (back-references, look-around, possessive repeats), are returned as they
are: outlines-core refuses them, or reads them its own way, as before.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
import warnings
from functools import lru_cache
from re import _constants as C
from re import _parser

from .char_dfa import LAST, _complement, _merged  # the same interval arithmetic as the state count

try:  # the lower case that re's IGNORECASE compares, one code point for one
    from _sre import unicode_tolower as _re_lower
except ImportError:  # not CPython
    _re_lower = None

SURROGATES = (0xD800, 0xDFFF)
# Rust's \s (the Unicode White_Space property, stable since Unicode 6.3).
RUST_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
              (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000))
# Letters among symbols (Other_Alphabetic So: circled and squared Latin letters): in Rust's \w.
RUST_WORD_SYMBOLS = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169), (0x1F170, 0x1F189))
JSON_UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x9F))  # outlines-core's string excludes these

Intervals = tuple[tuple[int, int], ...]


class _Keep(Exception):
    """The pattern uses what this printer does not print (said as the exception's text):
    outlines-core gets it unchanged, or inside a JSON string it is refused."""


_KEPT = {"AT": "an anchor inside it", "ASSERT": "a look-ahead or look-behind",
         "ASSERT_NOT": "a look-ahead or look-behind", "GROUPREF": "a back-reference",
         "GROUPREF_EXISTS": "a conditional group", "POSSESSIVE_REPEAT": "a possessive repeat",
         "ATOMIC_GROUP": "an atomic group"}


def for_outlines(pattern: str, json_string: bool = False, tree: _parser.SubPattern | None = None) -> str:
    """The pattern with every class spelt out as above; `^`/`\\A` at its start and `$`/`\\Z` at
    its end dropped (the answer matches the whole pattern anyway). A ValueError names a literal
    a JSON string cannot hold as it is. `tree`: Python's parse of the pattern, where the caller
    has it already."""
    if tree is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            try:
                tree = _parser.parse(pattern)
            except FutureWarning:  # the caller's check says why (constraints.check_read_alike)
                return pattern
            except re.error as e:
                if json_string:  # outlines-core's own syntax: its classes could take a quote
                    raise ValueError(f"not in Python's syntax ({e})") from None
                return pattern
    items = list(tree)
    if items and items[0][0] is C.AT and items[0][1] in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
        items = items[1:]
    if items and items[-1][0] is C.AT and items[-1][1] in (C.AT_END, C.AT_END_STRING):
        items = items[:-1]
    try:
        return _Printer(tree.state.flags, json_string).seq(items)
    except _Keep as e:
        if json_string:  # as written, its classes could take a quote and end the JSON string
            raise ValueError(f"it has {e}, which cannot be kept inside a JSON string as written") from None
        return pattern


class _Printer:
    def __init__(self, flags: int, json_string: bool) -> None:
        self.flags = flags
        self.json_string = json_string

    def seq(self, items) -> str:
        return "".join(self.item(op, av) for op, av in items)

    def item(self, op, av) -> str:
        if op is C.LITERAL:
            if self.json_string and _inside(av, JSON_UNSAFE):
                raise ValueError(f"the character {chr(av)!r} cannot be part of a JSON string as it is")
            return self.literal(av)
        if op is C.NOT_LITERAL:  # [^a]: under (?i), A is refused too
            return self.chars(_complement(self.folded(((av, av),), widest=True)))
        if op is C.ANY:
            everything = self.flags & re.DOTALL
            return self.chars(((0, LAST),) if everything else ((0, 9), (11, LAST)))
        if op is C.IN:
            return self.chars(self.members(av))
        if op is C.BRANCH:
            return "(?:" + "|".join(self.seq(b) for b in av[1]) + ")"
        if op is C.SUBPATTERN:
            _, add, remove, sub = av
            saved = self.flags
            self.flags = (self.flags | add) & ~remove
            try:
                inner = self.seq(sub)
            finally:
                self.flags = saved
            return "(?:" + inner + ")"  # flags spelt out inside: Rust is never asked to fold
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            low, high, sub = av
            bound = f"{{{low},}}" if high is C.MAXREPEAT else f"{{{low},{high}}}"
            return "(?:" + self.seq(sub) + ")" + bound + ("?" if op is C.MIN_REPEAT else "")
        raise _Keep(_KEPT.get(str(op), "what Rust's regex lacks"))

    def literal(self, code: int) -> str:
        """One character; under IGNORECASE, with its other cases as a class (never Rust's own (?i):
        its folding is Unicode 16's, and adds what Python 3.11's does not, U+A7DC for U+019B)."""
        if self.flags & re.IGNORECASE:
            return self.chars(self.folded(((code, code),)))
        return _escape(code)

    def folded(self, intervals, widest: bool = False) -> Intervals:
        """Under IGNORECASE, the code points with their other cases: those Python surely folds
        together (the same lower case), or with `widest` every one it might (lower and upper case
        links, followed through: Python's special folds, such as s and U+017F, among them), for a
        class that forbids them. With ASCII, ASCII letters' cases only, as (?ai) folds."""
        intervals = _merged(intervals)
        if not self.flags & re.IGNORECASE:
            return intervals
        starts = [lo for lo, _ in intervals]

        def inside(code: int) -> bool:
            i = bisect.bisect_right(starts, code) - 1
            return i >= 0 and code <= intervals[i][1]

        extra = [(c, c) for code, group in _case_groups(widest).items() if inside(code) for c in group
                 if not self.flags & re.ASCII or code < 128 and c < 128]
        return _merged(list(intervals) + extra)

    def members(self, av) -> Intervals:
        negate = any(o is C.NEGATE for o, _ in av)
        parts: list[tuple[int, int]] = []
        for o, a in av:
            if o is C.LITERAL:
                parts.append((a, a))
            elif o is C.RANGE:
                parts.append(a)
            elif o is C.CATEGORY:
                # in a class that allows, what both put in the category; in one that forbids,
                # what either might
                parts += _category(a, ascii_only=bool(self.flags & re.ASCII), sure=not negate)
            elif o is not C.NEGATE:
                raise _Keep("a class Rust's regex lacks")
        # a class that forbids, under (?i), forbids every case Python might fold its members to
        return _complement(self.folded(parts, widest=True)) if negate else self.folded(parts)

    def chars(self, intervals: Intervals) -> str:
        intervals = _minus(intervals, (SURROGATES,))  # no UTF-8 text holds them
        if self.json_string:
            intervals = _minus(intervals, JSON_UNSAFE)
        if not intervals:
            raise ValueError("a character class that no character can match here")
        if len(intervals) == 1 and intervals[0][0] == intervals[0][1]:
            return _escape(intervals[0][0])
        return "[" + "".join(_range(lo, hi) for lo, hi in intervals) + "]"


def _category(name, ascii_only: bool, sure: bool) -> Intervals:
    """The code points of a shorthand class (`\\d` ...): with `sure`, those both Python and Rust
    put in it; otherwise those either might (code points Python's Unicode leaves unassigned too)."""
    negated = str(name).startswith("CATEGORY_NOT_")
    base = str(name).replace("CATEGORY_NOT_", "CATEGORY_")
    if ascii_only:
        plain = {"CATEGORY_DIGIT": ((48, 57),), "CATEGORY_SPACE": ((9, 13), (32, 32)),
                 "CATEGORY_WORD": ((48, 57), (65, 90), (95, 95), (97, 122))}.get(base)
        if plain is None:
            raise _Keep("a class Rust's regex lacks")
        return _complement(plain) if negated else plain
    if base not in ("CATEGORY_DIGIT", "CATEGORY_SPACE", "CATEGORY_WORD"):
        raise _Keep("a class Rust's regex lacks")  # the line-break categories of the old sre syntax
    # \D in a class that allows is the complement of what \d might hold, and so on
    inner, outer = _unicode_sets(base)
    if negated:
        return _complement(outer) if sure else _complement(inner)
    return inner if sure else outer


@lru_cache(maxsize=None)
def _unicode_sets(base: str) -> tuple[Intervals, Intervals]:
    """(in both Python's and Rust's class, in either or unassigned in Python's Unicode)."""
    python = {"CATEGORY_DIGIT": r"\d", "CATEGORY_SPACE": r"\s", "CATEGORY_WORD": r"\w"}[base]
    ours = re.compile(python)
    py = _where(lambda c: ours.match(c) is not None)
    unassigned = _unassigned()
    if base == "CATEGORY_DIGIT":  # Rust's \d: Nd in its Unicode, which only adds to Python's
        rust = py
    elif base == "CATEGORY_SPACE":
        rust = RUST_SPACE
    else:  # Rust's \w: Alphabetic, marks, decimal digits, connector punctuation, joiners
        rust = _merged(_where(lambda c: unicodedata.category(c)[0] in "LM" or unicodedata.category(c) in
                              ("Nd", "Nl", "Pc")) + RUST_WORD_SYMBOLS + ((0x200C, 0x200D),))
    inner = _minus(_minus(py, _complement(rust)), unassigned)
    outer = _merged(py + rust + unassigned)
    return inner, outer


@lru_cache(maxsize=None)
def _unassigned() -> Intervals:
    return _where(lambda c: unicodedata.category(c) == "Cn")


def _where(test) -> Intervals:
    out, start = [], None
    for code in range(LAST + 1):
        ok = not SURROGATES[0] <= code <= SURROGATES[1] and test(chr(code))
        if ok and start is None:
            start = code
        elif not ok and start is not None:
            out.append((start, code - 1))
            start = None
    if start is not None:
        out.append((start, LAST))
    return tuple(out)


@lru_cache(maxsize=None)
def _case_groups(widest: bool) -> dict[int, tuple[int, ...]]:
    """Each cased code point -> the others Python's IGNORECASE may match it with: those of the same
    lower case; with `widest`, every one linked to it by a lower or upper case, followed through
    (a superset of Python's folds, its special ones included: i, I and U+0131; s, S and U+017F)."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for code in range(LAST + 1):
        if SURROGATES[0] <= code <= SURROGATES[1]:
            continue
        ch = chr(code)
        # and the one-character lower case that Python's re itself compares (U+0130, a dotted
        # capital I, lowers to two characters, but re matches it with an i: `(?i)[^i]` let it pass)
        lower = (ch.lower(), chr(_re_lower(code))) if _re_lower else (ch.lower(),)
        for other in lower + (ch.upper(),) if widest else lower:
            if len(other) == 1 and ord(other) != code:
                a, b = root(code), root(ord(other))
                if a != b:
                    parent[a] = b
    members: dict[int, list[int]] = {}
    for code in parent:
        members.setdefault(root(code), []).append(code)
    for r, group in members.items():
        if r not in group:
            group.append(r)
    return {code: tuple(c for c in group if c != code) for group in members.values() for code in group}


def _minus(a, b) -> Intervals:
    """a without b."""
    comp = _complement(b)
    out = []
    for lo, hi in _merged(a):
        for clo, chi in comp:
            if clo > hi:
                break
            if chi >= lo:
                out.append((max(lo, clo), min(hi, chi)))
    return tuple(out)


def _inside(code: int, intervals) -> bool:
    return any(lo <= code <= hi for lo, hi in intervals)


def _escape(code: int) -> str:
    """One code point as both syntaxes read it: letters and digits as they are, the rest in hex."""
    if code < 128 and chr(code).isalnum():
        return chr(code)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _range(lo: int, hi: int) -> str:
    return _escape(lo) if lo == hi else _escape(lo) + ("" if hi == lo + 1 else "-") + _escape(hi)
