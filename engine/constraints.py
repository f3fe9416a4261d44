"""Constrained decoding: regex, choice and JSON-schema constraints as token automata on the device.

A constraint is compiled with outlines-core over the model's tokenizer vocabulary into a token
automaton: states, and for each state the tokens allowed and the state each leads to. EOS is
allowed exactly in final states. The automaton lives on the device, either dense
(`next_state[state, token]`, -1 = forbidden) or, when that would be large, as a list of edges;
the mask for a row follows the state reached by its *sampled* token on the device, so the next
step never waits for the host.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from . import char_dfa, index_child, json_schema
from .errors import ConstraintError
from .pattern import check_read_alike, longest_match, matches_empty, unanchored
from .regex_text import for_outlines

DENSE_LIMIT = 1 << 24  # states x vocabulary entries kept as a dense table
MAX_MATCH = 8192  # the longest answer a bounded constraint may spell out (compiles in ~1.5 s)
# The most states a constraint's DFA over characters may have. outlines-core walks the whole
# vocabulary from each: 8192 states took 7.6 s for a 50k-token vocabulary, 0.2 s for the tiny
# model's; short patterns can have 2^n (engine/char_dfa.py).
MAX_STATES = 16384
# The same for the DFA that searches for the pattern in a text, which outlines-core's regex
# library builds beside the anchored one, where it doubles with each round of a repeat:
# `A.{0,14}\.` has 31 states anchored and 24578 searching (0.5 s to compile).
MAX_SEARCH_STATES = 16384


@dataclass(frozen=True)
class Regex:
    """The answer must fully match this regular expression."""

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ConstraintError(f"a Regex's pattern must be a string, got {type(self.pattern).__name__}")


@dataclass(frozen=True)
class Choice:
    """The answer must be exactly one of these strings."""

    options: tuple[str, ...]

    def __init__(self, options):
        if isinstance(options, (str, bytes)):  # tuple("yes") would be the options y, e, s
            raise ConstraintError(f"Choice takes a list of strings, not one string: Choice([{options!r}])")
        try:
            object.__setattr__(self, "options", tuple(options))
        except TypeError:
            raise ConstraintError(f"Choice takes a list of strings, got {type(options).__name__}") from None


@dataclass(frozen=True)
class JsonSchema:
    """The answer must be JSON that validates against this schema (a dict or a JSON string)."""

    schema: str

    def __init__(self, schema):
        try:
            # As written: outlines-core generates an object's properties in the schema's order
            # (sorted, {"reasoning", "answer"} had come out answer first, and a dict and its
            # JSON text had given differently ordered answers).
            text = schema if isinstance(schema, str) else json.dumps(schema)
        except (TypeError, ValueError) as e:  # a set, an object, a circular dict
            raise ConstraintError(f"a JSON schema must be a dict or a JSON string: {e}") from None
        except RecursionError:  # a dict a thousand levels deep: Python's JSON writer recursed
            raise ConstraintError("cannot use the JSON schema: it is nested too deep") from None
        object.__setattr__(self, "schema", text)


Constraint = Regex | Choice | JsonSchema


def to_regex(constraint: Constraint) -> str:
    """The regex outlines-core compiles: spelt so that what it allows Python's `re` (and, for a
    schema, a JSON parser) accepts too (engine/regex_text.py, engine/json_schema.py)."""
    if isinstance(constraint, Regex):
        try:
            pattern, tree = unanchored(constraint.pattern)
            return for_outlines(pattern, tree=tree)
        except ConstraintError:  # names the regex already ("the regex '[': the regex '[' is not...")
            raise
        except ValueError as e:  # a class no character can match ([^\s\S])
            raise ConstraintError(f"the regex {constraint.pattern!r}: {e}") from None
    if isinstance(constraint, Choice):
        if not constraint.options or not all(isinstance(o, str) and o for o in constraint.options):
            raise ConstraintError("Choice needs a non-empty list of non-empty strings")
        return "(" + "|".join(re.escape(o) for o in constraint.options) + ")"
    if isinstance(constraint, JsonSchema):
        from outlines_core.json_schema import build_regex_from_schema

        try:
            schema = json.loads(constraint.schema)
        except ValueError:
            schema, text = None, constraint.schema  # not JSON: outlines-core says so below
        except RecursionError:  # a thousand levels deep: Python's JSON reader recursed (a traceback)
            raise ConstraintError("cannot use the JSON schema: it is nested too deep") from None
        if schema is not None:
            try:
                json_schema.check_depth(schema)  # before anything recurses through it
            except ValueError as e:
                raise ConstraintError(f"cannot use the JSON schema: {e}") from None
            key = json_schema.unenforced(schema)
            if key is not None:
                raise ConstraintError(f"the JSON schema keyword {key!r} is not supported: answers could break it "
                                      "(for a few allowed values, list them with enum)")
            try:
                text = json_schema.prepare(schema)
            except ValueError as e:
                raise ConstraintError(f"cannot use the JSON schema: {e}") from None
        try:
            pattern = build_regex_from_schema(text)
        except Exception as e:  # outlines-core raises ValueError / its own errors
            raise ConstraintError(f"cannot compile the JSON schema: {_first_line(e)}") from None
        check_read_alike(pattern)  # a pattern Python could not parse is in it as written
        if matches_empty(pattern):  # e.g. an empty enum: no JSON value is valid
            raise ConstraintError("no JSON value is valid against that schema")
        return pattern
    raise ConstraintError(f"unknown constraint {constraint!r} (use Regex, Choice or JsonSchema)")


class TokenAutomaton:
    """A compiled constraint on one device. State 0 is the initial state."""

    def __init__(self, next_state: dict[int, dict[int, int]], finals: set[int], vocab_size: int,
                 eos_id: int, device: torch.device):
        self.n_states = len(next_state)
        self.vocab_size = vocab_size
        self.dense = self.n_states * vocab_size <= DENSE_LIMIT
        src, tok, dst = [], [], []
        for s, edges in next_state.items():
            for t, d in edges.items():
                src.append(s), tok.append(t), dst.append(d)
            if s in finals:
                src.append(s), tok.append(eos_id), dst.append(s)
        if self.dense:
            table = torch.full((self.n_states, vocab_size), -1, dtype=torch.int64)
            table[torch.tensor(src), torch.tensor(tok)] = torch.tensor(dst)
            self.table = table.to(device)
        else:
            self.src = torch.tensor(src, device=device)
            self.tok = torch.tensor(tok, device=device)
            self.dst = torch.tensor(dst, device=device)

    @property
    def nbytes(self) -> int:
        """Device memory held by the tables."""
        tensors = (self.table,) if self.dense else (self.src, self.tok, self.dst)
        return sum(t.numel() * t.element_size() for t in tensors)

    def allowed(self, state_R: torch.Tensor) -> torch.Tensor:
        """Boolean (R, vocab) mask of the tokens allowed in each row's state."""
        if self.dense:
            return self.table[state_R] >= 0
        match = (self.src[None, :] == state_R[:, None]).to(torch.uint8)  # (R, E)
        out = torch.zeros(len(state_R), self.vocab_size, dtype=torch.uint8, device=state_R.device)
        out.scatter_reduce_(1, self.tok.expand(len(state_R), -1), match, "amax")
        return out.bool()

    def advance(self, state_R: torch.Tensor, token_R: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return self.table[state_R, token_R].clamp_(min=0)
        hit = (self.src[None, :] == state_R[:, None]) & (self.tok[None, :] == token_R[:, None])
        return (hit * self.dst[None, :]).sum(dim=1)


def compile_constraint(constraint: Constraint, tokenizer: Any, vocab_size: int, eos_id: int,
                       device: torch.device) -> TokenAutomaton:
    """Compile with outlines-core (in a child process: engine/index_child.py); a ConstraintError
    says why it cannot be done."""
    pattern = to_regex(constraint)
    longest = longest_match(pattern)
    if longest is not None and longest > MAX_MATCH:
        # The automaton grows with it: a{20000} took 4 s and 0.5 GB, a{1000000} never ended.
        raise ConstraintError(f"the constraint allows answers of {longest} characters; at most {MAX_MATCH} "
                              "(fewer repetitions, or an open-ended * or +)")
    if (char_dfa.states(pattern, MAX_STATES) or 0) > MAX_STATES:
        raise ConstraintError(f"the constraint is too complex: its automaton has over {MAX_STATES} states "
                              "(a Choice of thousands of options, or a repeat after an open-ended one, as in "
                              "(a|b)*a(a|b){20}, which doubles them with each repetition)")
    # Searching, only a doubling automaton is refused here: counted whole, linear ones overshoot
    # (an array of 100 JSON objects counted over 2^17 states; outlines-core built it in 0.5 s),
    # and the compiler's child stops what is slow. A Choice's is a trie's (Aho-Corasick).
    if not isinstance(constraint, Choice) and char_dfa.search_doubles(pattern, MAX_SEARCH_STATES):
        raise ConstraintError(f"the constraint is too complex: the automaton that finds it in a text has over "
                              f"{MAX_SEARCH_STATES} states (a bounded repeat of a class that also holds what "
                              "comes before or after it, as in [A-Z].{0,100}[.!?], doubles them with each "
                              "repetition; [A-Z][a-z ,]{0,100}[.!?] does not)")
    try:
        initial, transitions, final_states = index_child.build(pattern, eos_id,
                                                               token_bytes(tokenizer, vocab_size, eos_id))
    except index_child.CompileError as e:
        raise ConstraintError(f"cannot compile constraint {_shown(constraint, pattern)!r}: {e}") from None
    order = [initial] + sorted(set(transitions) - {initial})
    order += sorted({d for edges in transitions.values() for d in edges.values()} - set(order))
    order += sorted(set(final_states) - set(order))
    number = {s: i for i, s in enumerate(order)}
    next_state = {number[s]: {} for s in order}
    for s, edges in transitions.items():
        for t, d in edges.items():
            if t != eos_id:
                next_state[number[s]][t] = number[d]
    finals = {number[s] for s in final_states}
    if not next_state[0] and 0 not in finals:
        raise ConstraintError(f"no token sequence of this model can satisfy {_shown(constraint, pattern)!r}")
    return TokenAutomaton(next_state, finals, vocab_size, eos_id, device)


def _shown(constraint: Constraint, pattern: str) -> str:
    """A Regex as its user wrote it (the pattern compiled spells its classes out), else the regex."""
    return constraint.pattern if isinstance(constraint, Regex) else pattern


def token_bytes(tokenizer: Any, vocab_size: int, eos_id: int) -> dict[bytes, list[int]]:
    """Each ordinary token's bytes as it appears in decoded text (special tokens excluded)."""
    hf = tokenizer._tok
    specials = set(hf.get_added_tokens_decoder())
    byte_level = type(hf.decoder).__name__ == "ByteLevel"
    table = {c: b for b, c in _bytes_to_unicode().items()}
    out: dict[bytes, list[int]] = {}
    for token, i in hf.get_vocab(with_added_tokens=False).items():
        if i >= vocab_size or i == eos_id or i in specials:
            continue
        if byte_level and all(c in table for c in token):
            data = bytes(table[c] for c in token)
        else:
            data = hf.decode([i]).encode("utf-8")
        if data:
            out.setdefault(data, []).append(i)
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
