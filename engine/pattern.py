"""A regex as Python reads it, checked before a constraint is compiled: Python's `re` checks
answers (ours, and users', the README says "in Python's syntax"), outlines-core compiles them,
so a pattern the two would read otherwise is refused (`check_read_alike`), anchors at its ends
are taken off and anchors inside it refused (`unanchored`), and the longest answer it allows is
counted (`longest_match`) before any automaton is built.
"""

from __future__ import annotations

import re
import warnings
from re import _constants, _parser

from . import char_dfa
from .errors import ConstraintError


def check_read_alike(pattern: str) -> None:
    """A ConstraintError where Python's `re` (which checks answers, here and for users) would read
    the pattern otherwise than outlines-core: a `[` inside a set (`[[:alpha:]]`, a class to
    outlines-core, a `[` and letters to Python), or `&&`, `--`, `~~`, `||` there."""
    _parsed(pattern)


def _parsed(pattern: str) -> _parser.SubPattern | None:
    """Python's parse of the pattern; None where Python cannot parse it (outlines-core's own
    syntax beyond Python's: its compiler decides). Python only warns of the ambiguities above (a
    FutureWarning, printed to the user with our source lines): here they are a ConstraintError."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        try:
            return _parser.parse(pattern)  # not re.compile: a pattern in its cache would not warn again
        except FutureWarning as w:
            raise ConstraintError(f"the regex {pattern!r} is ambiguous ({str(w).lower()}): inside [...], escape "
                                  "a [ or a doubled &, -, ~, | (\\[, \\&) and spell classes out ([a-zA-Z], "
                                  "not [[:alpha:]])") from None
        except re.error:
            return None
        except RecursionError:  # groups a few hundred deep: Python's parser recursed (a traceback, exit 1)
            raise ConstraintError("the regex is nested too deep (groups inside groups, hundreds of levels)") from None


def unanchored(pattern: str) -> tuple[str, _parser.SubPattern]:
    """The pattern, and Python's parse of it, without a `^` (or `\\A`) in front and a `$` (or
    `\\Z`) at its end: the answer
    matches the whole pattern anyway, and outlines-core refuses anchors ("Index failed since
    anchored universal start state doesn't exist", for `^[0-9]+$`). Anchors elsewhere are a
    ConstraintError that says so, as is an ambiguity `check_read_alike` refuses."""
    for start in ("^", "\\A"):
        if pattern.startswith(start):
            pattern = pattern[len(start):]
            break
    for end in ("$", "\\Z"):
        head = pattern[:-len(end)]
        # `\$` is a dollar, `\\Z` a backslash and a Z: the end is an anchor only where unescaped
        if pattern.endswith(end) and (len(head) - len(head.rstrip("\\"))) % 2 == 0:
            pattern = head
            break
    tree = _parsed(pattern)
    if tree is None:  # outlines-core's own syntax (`\p{L}`, `\z`, `(?<name>...)`): no answer could be checked
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConstraintError(f"the regex {pattern!r} is not in Python's syntax ({e}): answers are checked "
                                  "with Python's re") from None
    if _has_anchor(tree):
        raise ConstraintError(f"the regex {pattern!r} has an anchor (^, $, \\b, \\A, \\Z) inside it: the answer "
                              "matches the whole pattern anyway (^ at its start and $ at its end are fine)")
    return pattern, tree


def _has_anchor(node) -> bool:
    """Whether a parsed pattern holds an AT (^, $, \\b, ...) anywhere, in groups, branches, repeats."""
    if isinstance(node, _parser.SubPattern):
        return any(op is _constants.AT or _has_anchor(av) for op, av in node)
    return isinstance(node, (list, tuple)) and any(map(_has_anchor, node))


def matches_empty(pattern: str) -> bool:
    try:
        return re.fullmatch(pattern, "") is not None
    except re.error:
        return False


def longest_match(pattern: str) -> int | None:
    """The longest string the pattern matches, an open-ended repeat counted once (None where
    Python cannot parse it)."""
    tree = char_dfa.parse(pattern)
    return None if tree is None else _longest(tree)


def _longest(items) -> int:
    from re._constants import MAXREPEAT

    total = 0
    for op, av in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = av
            total += _longest(sub) * (max(low, 1) if high is MAXREPEAT else high)
        elif name == "SUBPATTERN":
            total += _longest(av[-1])
        elif name == "BRANCH":
            total += max((_longest(b) for b in av[1]), default=0)
        elif name == "ATOMIC_GROUP":
            total += _longest(av)
        elif name == "GROUPREF_EXISTS":
            total += max(_longest(av[1]), _longest(av[2]) if av[2] is not None else 0)
        elif name not in ("AT", "ASSERT", "ASSERT_NOT"):
            total += 1  # one character: a literal, a class, any
    return total
