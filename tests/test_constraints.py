import json
import os
import re
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import pytest
from outlines_core import Index, Vocabulary

import engine.constraints as constraints_module
from engine import Choice, ConstraintError, Engine, EngineConfig, JsonSchema, Regex, SamplingParams
from engine import char_dfa
from engine.constraints import MAX_SEARCH_STATES, MAX_STATES, compile_constraint, to_regex, token_bytes
from engine.models.loader import load_model
from engine.reference import ReferenceDecoder

IMAGES = [np.random.default_rng(i).integers(0, 256, size=(60, 80, 3), dtype=np.uint8) for i in range(3)]
SCHEMA = {"type": "object", "properties": {"shape": {"type": "string", "enum": ["circle", "star"]},
                                          "count": {"type": "integer", "enum": list(range(10))}},
          "required": ["shape", "count"]}
CONSTRAINTS = [Regex(r"(red|green|blue) (circle|square|star)"), Choice(["yes", "no", "maybe not"]),
               JsonSchema(SCHEMA), Regex(r"^[0-9]{1,3}$")]  # anchors at the ends: outlines-core refused them


def _valid(constraint, text):
    if isinstance(constraint, Regex):
        return re.fullmatch(constraint.pattern, text) is not None
    if isinstance(constraint, Choice):
        return text in constraint.options
    obj = json.loads(text)
    return set(obj) == {"shape", "count"} and obj["shape"] in ("circle", "star") and obj["count"] in range(10)


def _outlines_accepts(loaded, constraint, tokens):
    """Walk outlines-core's own index: every token must be allowed where it was emitted."""
    vocab = Vocabulary(loaded.config.tokenizer.eos_id,
                       token_bytes(loaded.tokenizer, loaded.config.text.vocab_size, loaded.config.tokenizer.eos_id))
    index = Index(to_regex(constraint), vocab)
    state = index.get_initial_state()
    for t in tokens:
        assert t in index.get_allowed_tokens(state)
        state = index.get_next_state(state, t)
    return index.is_final_state(state)


@pytest.fixture(scope="module")
def small(small_folder):
    return load_model(small_folder)


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: type(c).__name__)
def test_engine_outputs_satisfy_constraints_and_match_the_reference(small_folder, small, constraint):
    ref = ReferenceDecoder(small)
    jobs = []
    with Engine(EngineConfig(model=str(small_folder), debug_checks=True)) as eng:
        for i, img in enumerate(IMAGES):
            for temperature in (0.0, 1.0):
                params = SamplingParams(max_tokens=60, temperature=temperature, top_p=1.0, seed=i)
                jobs.append((img, params, eng.submit(img, question="What is it?", params=params,
                                                     constraint=constraint)))
        outs = [(img, params, h.result(timeout=60)) for img, params, h in jobs]
    for img, params, out in outs:
        expected = ref.generate(img, question="What is it?", params=params, constraint=constraint)
        assert out.token_ids == expected.token_ids
        final = _outlines_accepts(small, constraint, out.token_ids)
        if out.finish_reason == "stop":
            assert final and _valid(constraint, out.text), out.text
        else:  # cut by max_tokens: still a valid beginning (checked token by token above)
            assert out.finish_reason == "length"


def test_choice_always_completes(small_folder):
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        outs = [eng.submit(img, question="Is there a star?", constraint=Choice(["yes", "no"]),
                           params=SamplingParams(max_tokens=20, temperature=1.0, top_p=1.0, seed=s)).result(30)
                for s, img in enumerate(IMAGES * 3)]
    assert all(o.finish_reason == "stop" and o.text in ("yes", "no") for o in outs)


def test_compiled_constraints_kept_for_reuse_are_bounded(small_folder, monkeypatch):
    """Choices that change with every frame (the objects seen, say) had each kept its table for the
    engine's life: at Moondream 2's vocabulary 12 MB apiece, without end. The cache now holds
    what its budget allows, the most recently used; a request keeps its own automaton either way."""
    import engine.constraint_cache as cache_module

    with Engine(EngineConfig(model=str(small_folder))) as eng:
        cache = eng._constraints
        one = cache.get(Choice(["answer 0", "other 0"])).nbytes
        monkeypatch.setattr(cache_module, "CONSTRAINT_CACHE_BYTES", 5 * one)
        real, compiled = cache_module.compile_constraint, []
        monkeypatch.setattr(cache_module, "compile_constraint", lambda c, *args: compiled.append(c) or real(c, *args))
        hot = Choice(["yes", "no"])
        for i in range(40):
            eng.check_constraint(Choice([f"answer {i}", f"other {i}"]))
            eng.check_constraint(hot)  # asked all along: it stays
        assert cache.nbytes() <= 5 * one
        assert len(cache) < 10 and hot in cache
        assert compiled.count(hot) == 1  # least recently used dropped first: never hot (first in, last asked)
        assert Choice(["answer 39", "other 39"]) in cache and Choice(["answer 0", "other 0"]) not in cache
        out = eng.submit(IMAGES[0], question="Is there a star?", constraint=Choice(["answer 0", "other 0"]),
                         params=SamplingParams(max_tokens=20)).result(30)  # compiled again
        assert out.text in ("answer 0", "other 0")


def test_a_constraint_that_cannot_compile_is_refused_once_then_at_once(small_folder, monkeypatch):
    """A failed compile was not kept: each retry of a constraint that ran out its 30 s in the
    compiler's child waited the 30 s again, on the submitting thread."""
    import engine.constraint_cache as cache_module

    calls = []
    real = cache_module.compile_constraint

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_module, "compile_constraint", counted)
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        for _ in range(3):
            with pytest.raises(ConstraintError, match="too complex"):
                eng.submit(IMAGES[0], question="x?", constraint=Regex("[A-Z].{0,100}[.!?]"))
        assert len(calls) == 1
        assert eng.submit(IMAGES[0], caption="short", params=SamplingParams(max_tokens=3)).result(30)


def test_constraints_refused_are_remembered_up_to_a_bound(monkeypatch):
    """Refusals are kept (a retry is refused at once) but not without end: constraints that
    change with every frame each leave their reason, the oldest forgotten first."""
    import engine.constraint_cache as cache_module

    calls = []

    def refuse(constraint, *args):
        calls.append(constraint.pattern)
        raise ConstraintError(f"not {constraint.pattern}")

    monkeypatch.setattr(cache_module, "compile_constraint", refuse)
    monkeypatch.setattr(cache_module, "REFUSED_KEPT", 2)
    cache = cache_module.ConstraintCache(None, 8, 0, "cpu")
    for p in "abcbca":
        with pytest.raises(ConstraintError, match=f"not {p}"):
            cache.get(Regex(p))
    assert calls == ["a", "b", "c", "a"]  # b and c kept; a dropped for c, asked again, compiled again


def test_sparse_automaton_equals_dense(small, monkeypatch):
    c = JsonSchema(SCHEMA)
    dense = compile_constraint(c, small.tokenizer, small.config.text.vocab_size, 0, small.device)
    monkeypatch.setattr(constraints_module, "DENSE_LIMIT", 0)
    sparse = compile_constraint(c, small.tokenizer, small.config.text.vocab_size, 0, small.device)
    assert dense.dense and not sparse.dense
    # the cache's bound is in bytes of device memory: int64 entries, 8 bytes each
    assert dense.nbytes == dense.n_states * small.config.text.vocab_size * 8
    assert sparse.nbytes == 3 * len(sparse.src) * 8 > 0
    import torch

    states = torch.arange(dense.n_states)
    assert torch.equal(dense.allowed(states), sparse.allowed(states))
    for t in range(0, small.config.text.vocab_size, 7):
        tok = torch.full_like(states, t)
        ok = dense.allowed(states)[:, t]
        assert torch.equal(dense.advance(states, tok)[ok], sparse.advance(states, tok)[ok])


@pytest.mark.parametrize("bad", [
    Regex("(unclosed"), Choice([]), JsonSchema('{"type": "nonsense"}'), "not a constraint", Regex("a{3,1}"),
    {"type": "string"}, ["yes", "no"], Choice(["yes", ["no"]]),  # unhashable: a TypeError before
    # Keywords outlines-core ignores: answers broke them ('8' for a maximum of 5).
    JsonSchema({"type": "integer", "maximum": 5}), JsonSchema({"type": "integer", "minimum": 5, "maximum": 1}),
    JsonSchema({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}),
    JsonSchema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    JsonSchema({"enum": []}),  # no JSON value: the answer was ''
    Regex("a{1000000}"), JsonSchema({"type": "string", "maxLength": 100000}),  # never finished compiling
    # 2^19 states: 32 s and 1.3 GB to compile, then refused by nothing.
    Regex("(a|b)*a(a|b){18}"), JsonSchema({"type": "string", "pattern": "[xy]*x[xy]{18}"}),
    # a few hundred states, but ~2^100 in the automaton that searches for it: never compiled
    Regex("[A-Z].{0,100}[.!?]"), Regex("[A-Z][^.!?]{0,100}[.!?]"), Regex(r"A.{0,16}\."),
    JsonSchema({"type": "string", "maxLength": 30}),  # counted whole it ran out of time: 30 s in the child
    # read otherwise by Python (which checks the answers) than by outlines-core: a class there
    Regex("[[:digit:]]+"), JsonSchema({"type": "string", "pattern": "^[a-z--q]+$"}),
    Regex("(a|^b)c"), Regex(r"\bred\b"),  # an anchor inside: said as one, not as a failed index
], ids=repr)
def test_constraints_that_cannot_compile(small_folder, bad):
    import warnings

    with Engine(EngineConfig(model=str(small_folder))) as eng, warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # Python's, about the pattern, printed with our lines
        t0 = time.perf_counter()
        with pytest.raises(ConstraintError) as err:
            eng.submit(IMAGES[0], question="x?", constraint=bad)
        assert "\n" not in str(err.value) and time.perf_counter() - t0 < 5
        assert eng.submit(IMAGES[0], caption="short", params=SamplingParams(max_tokens=3)).result(30)


def test_schema_keywords_are_checked_in_subschemas_only():
    """A property may be called "maximum", and an enum may hold one; the keyword in a nested
    subschema is still found."""
    assert to_regex(JsonSchema({"type": "object", "properties": {"maximum": {"enum": ["minimum"]}}}))
    nested = {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "number", "exclusiveMaximum": 1}}]}
    with pytest.raises(ConstraintError, match="exclusiveMaximum"):
        to_regex(JsonSchema(nested))


def test_schema_properties_keep_their_order():
    """An object's properties come in the schema's order, as outlines-core generates them, whether
    the schema is a dict or its JSON text (sorted, "shape" had come after "count")."""
    text = json.dumps(SCHEMA)
    pattern = to_regex(JsonSchema(SCHEMA))
    assert pattern == to_regex(JsonSchema(text))
    assert pattern.index("shape") < pattern.index("count")
    assert re.fullmatch(pattern, '{"shape": "star", "count": 3}')


def test_long_but_bounded_constraints_still_compile(small):
    """The limit is on the longest answer, not on the pattern's look: open-ended repeats and
    alternations of many options pass."""
    vocab, eos = small.config.text.vocab_size, small.config.tokenizer.eos_id
    boxes = {"type": "array", "maxItems": 100, "items": {"type": "object", "properties": {
        "shape": {"enum": ["circle", "square", "triangle", "star"]}, "colour": {"type": "string"}}}}
    for c in (Regex("[a-z ]+"), Regex(r"(\d{1,3}\.){3}\d{1,3}"), Choice([f"option {i}" for i in range(300)]),
              Regex("[a-z]{0,100}(,[a-z]{0,100}){0,50}"), Regex("(a|b)*a(a|b){12}"), JsonSchema(boxes),
              # the automaton that searches for these stays small: a match ends the search
              Regex("(yes|no): .{1,100}"), Regex("[A-Z][a-z ,]{0,200}[.!?]"), Regex("(a?){1000}")):
        assert compile_constraint(c, small.tokenizer, vocab, eos, small.device).n_states > 1


def test_too_long_or_too_many_states_is_refused_before_any_compile(small, monkeypatch):
    """Each bound on its own: `a{10000}` has few enough states (10001) but spells out more than
    MAX_MATCH characters; a Choice of thousands of options is never counted searching (a trie)
    but its own automaton has over MAX_STATES states. Both are refused before the compiler's
    child starts (compiling them at a 50k vocabulary takes many seconds)."""
    import random

    import engine.index_child as index_child

    def never(*args):
        raise AssertionError("compiled")

    monkeypatch.setattr(index_child, "build", never)
    vocab, eos = small.config.text.vocab_size, small.config.tokenizer.eos_id
    rng = random.Random(0)
    options = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(10)) for _ in range(2500)})
    # an open-ended repeat counts its body once, even where it may be left out; a branch its longest
    longest = [Regex("a{10000}"), Regex("(x{9000})*"), Regex("b|x{9000}")]
    for c, said in [(c, "at most 8192") for c in longest] + [(Choice(options), f"over {MAX_STATES} states")]:
        with pytest.raises(ConstraintError, match=said):
            compile_constraint(c, small.tokenizer, vocab, eos, small.device)


def test_a_choice_with_an_empty_option_is_refused():
    with pytest.raises(ConstraintError, match="non-empty strings"):
        to_regex(Choice(["", "yes"]))


def test_special_tokens_are_never_part_of_an_answer(small):
    """The tiny tokenizer's special tokens sit in its base vocabulary, spelt as printable text
    ('<|answer|>'): read as bytes they were allowed wherever a constraint allows their text."""
    vocab, eos = small.config.text.vocab_size, small.config.tokenizer.eos_id
    specials = set(small.tokenizer._tok.get_added_tokens_decoder())
    assert specials - {eos}
    ids = {i for ids in token_bytes(small.tokenizer, vocab, eos).values() for i in ids}
    assert ids and not ids & specials


def test_an_interrupted_compile_stops_its_child(small, monkeypatch):
    """Ctrl-C on the submitting thread while the child compiles (the slow pattern below: 20 s
    and 800 MB): the child is killed at once, not waited for to the end of its compile."""
    import subprocess

    import engine.index_child as index_child

    started = []

    class Interrupted(subprocess.Popen):
        def communicate(self, input=None, timeout=None):
            if input is None:
                return super().communicate(input, timeout)
            started.append(self)
            try:
                return super().communicate(input, 0.5)  # the pattern is sent, the compile under way
            except subprocess.TimeoutExpired:
                raise KeyboardInterrupt from None

    vocab, eos = small.config.text.vocab_size, small.config.tokenizer.eos_id
    monkeypatch.setattr(index_child.subprocess, "Popen", Interrupted)
    try:
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            index_child.build(to_regex(Regex(r"[a-c].{1,11}\W*\d")), eos, token_bytes(small.tokenizer, vocab, eos))
        assert time.perf_counter() - t0 < 5
        assert len(started) == 1 and started[0].returncode is not None
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_compile_past_its_time_or_memory_is_refused_and_stopped(small, monkeypatch):
    """A few dozen states, but Unicode classes under a bounded repeat: outlines-core took 20 s and
    800 MB for this pattern on the submitting thread, which nothing could stop. The compile runs
    in a child process now, killed past its limits."""
    import engine.index_child as index_child

    vocab, eos = small.config.text.vocab_size, small.config.tokenizer.eos_id
    slow = Regex(r"[a-c].{1,11}\W*\d")
    for limit, value, said in (("TIMEOUT_S", 1.0, "took over 1 s"), ("MEMORY_BYTES", 150 << 20, "memory")):
        monkeypatch.setattr(index_child, limit, value)
        t0 = time.perf_counter()
        with pytest.raises(ConstraintError, match=said):
            compile_constraint(slow, small.tokenizer, vocab, eos, small.device)
        assert time.perf_counter() - t0 < 15
        monkeypatch.undo()
    # this process's own: another test process (pytest -n 2) may be compiling at the same moment
    children = [p for p in Path("/proc").glob("[0-9]*") if _reads(p / "cmdline").startswith(sys.executable.encode() + b"\0")
                and b"outlines_core" in _reads(p / "cmdline")
                and _reads(p / "stat").rsplit(b")", 1)[-1].split()[1:2] == [str(os.getpid()).encode()]]
    assert not children  # none left running
    assert compile_constraint(Regex("[a-z ]+"), small.tokenizer, vocab, eos, small.device).n_states > 1


def test_a_class_of_thousands_of_characters_is_counted_in_a_moment(small):
    """Each of a class's 6000 boundaries scanned every interval of every move: a class of 3000
    characters took two minutes to count on the submitting thread, before any compile."""
    cls = "".join(chr(0x4E00 + 2 * i) for i in range(3000))
    vocab, eos = small.config.text.vocab_size, small.config.tokenizer.eos_id
    t0 = time.perf_counter()
    assert compile_constraint(Regex(f"[{cls}]{{1,40}}"), small.tokenizer, vocab, eos, small.device).n_states > 40
    assert time.perf_counter() - t0 < 15


def test_the_compilers_child_does_not_import_from_the_working_folder(small, tmp_path, monkeypatch):
    """`python -c` puts the working folder first on the import path: a pickle.py there (a user's
    script) was imported by the child in place of the real module, and every constraint failed."""
    (tmp_path / "pickle.py").write_text("raise SystemExit('not the pickle module')\n")
    monkeypatch.chdir(tmp_path)
    vocab, eos = small.config.text.vocab_size, small.config.tokenizer.eos_id
    assert compile_constraint(Choice(["yes", "no"]), small.tokenizer, vocab, eos, small.device).n_states > 1


def _reads(path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile
        return b""


@pytest.mark.parametrize("pattern, search, n", [
    ("abc", False, 4), ("(yes|no)", False, 5), ("(a|b)*a(a|b){3}", False, 16), ("(a|b)*a(a|b){10}", False, 2048),
    (r"\d+(\.\d+)?", False, 4), ("[a-c]{0,5}", False, 6), ("(foo|bar)+baz", False, 11), ("x{8192}", False, 8193),
    ("(a|b)*a(a|b){16}", False, MAX_STATES + 1), ("(a|b)*a(a|b){60}", False, MAX_STATES + 1),
    ("x?|(a|b)*a(a|b){14}", False, 2),  # leftmost-first: the empty match ends it, as outlines-core builds it
    (r"A.{0,12}\.", False, 27), (r"A.{0,12}\.", True, 8216), (r"A.{0,16}\.", True, MAX_SEARCH_STATES + 1),
    ("(yes|no): .{1,100}", True, 107),  # a match stops the search: no new threads after it
    ("x{16383}", False, MAX_STATES),  # exactly at the limit: counted, not called over it
    ("(a?){1000}", False, None),  # sets of a thousand nodes: too slow to count, not counted
    (r"(a)\1", False, None), (r"\p{L}+", False, None),  # not Python's syntax: not counted
])
def test_dfa_states_are_counted_up_to_the_limit(pattern, search, n):
    """The count a constraint is refused on: exact where small (the subset construction's own
    states), and it stops past the limit, however many states there are."""
    assert char_dfa.states(pattern, MAX_STATES, search=search) == n


@pytest.mark.parametrize("pattern, doubles", [
    ("[A-Z].{0,100}[.!?]", True), ("x[a-z]{20}", True), ("(a|b)*a(a|b){18}", True),
    (r"A.{0,12}\.", False), ("a[a-z]{13}", False),  # doubling, but 2^13 states at most: under the limit
    ("a[a-z]{14}", True),  # 16385 states: one round more is just over it
    ("[A-Z].{100,}[.!?]", True),  # an open-ended repeat of 100 rounds at least is cut to the cap too
    ('"([^"\\\\]|\\\\["\\\\/bfnrt]){0,30}"', True),  # a JSON string of maxLength 30: 17 s at 18 already
    ("a{8192}", False), ("(yes|no): .{1,100}", False), ("[a-z]{0,100}(,[a-z]{0,100}){0,50}", False),
    (r"\[(\{\"id\":[0-9]{1,5}\}(,\{\"id\":[0-9]{1,5}\}){0,49})?\]", False),
])
def test_a_search_automaton_that_doubles_with_each_round_is_told_from_a_linear_one(pattern, doubles):
    """Counted whole, `[A-Z].{0,100}[.!?]` ran out of time and passed; `a[a-z]{13}` (8193
    states, compiled in 10 ms) was refused for doubling at all."""
    assert char_dfa.search_doubles(pattern, MAX_SEARCH_STATES) is doubles


@pytest.mark.parametrize("schema, said", [
    # outlines-core joined allOf's schemas end to end: '{ "a":11 }{ "b": false }'
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}, "allOf"),
    ({"allOf": [{"type": "integer"}, {"enum": [1, 2]}]}, "allOf"),  # '432112222111'
    ({"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]}, "oneOf"),  # read as anyOf: '2' meets both
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "required": ["z"]}, "'z'"),  # '{}'
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "'b'"),
    ({"type": "integer", "enum": [1.5, 2]}, "1.5"),  # type ignored beside enum: '1.5'
    ({"type": "string", "const": 3}, "3"),
    ({"type": ["integer", "null"], "enum": [None, 1.5]}, "1.5"),  # a list of types beside them too
    ({"oneOf": [{"enum": [1]}, {"enum": [1.0]}]}, "oneOf"),  # 1 and 1.0 are one JSON number: '1' meets both
    # keywords outlines-core ignores, wherever a schema stands: $defs too (a $ref to it)
    ({"$defs": {"n": {"type": "integer", "maximum": 5}}, "$ref": "#/$defs/n"}, "'maximum'"),
    ({"definitions": {"n": {"type": "integer", "minimum": 5}}, "$ref": "#/definitions/n"}, "'minimum'"),
    ({"type": "object", "maxProperties": 1}, "'maxProperties'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, "'dependentSchemas'"),
    # an empty subschema printed as an empty value: '{ "e":  }', or '[,,,,'
    ({"type": "object", "properties": {"e": {"enum": []}}, "required": ["e"]}, "empty 'enum'"),
    ({"type": "object", "properties": {"e": {"anyOf": []}}, "required": ["e"]}, "empty 'anyOf'"),
    ({"type": "array", "items": {"enum": []}, "minItems": 1}, "empty 'enum'"),
    # of a string's pattern, format and length outlines-core enforced one and dropped the rest
    ({"type": "string", "pattern": "[a-z]+", "minLength": 3}, "together"),
    ({"type": "string", "format": "date", "maxLength": 10}, "together"),
    ({"type": "string", "pattern": "[a-z]+", "format": "email"}, "together"),
    ({"type": "string", "format": "ipv4"}, "not supported"),
    ({"type": "string", "pattern": 'say "hi"'}, "cannot be part of a JSON string"),
    # a pattern the printer cannot spell out went in as written, its classes free to take a quote
    ({"type": "string", "pattern": "\\bcat\\b"}, "it has an anchor inside it, which cannot be kept inside a JSON"),
], ids=repr)
def test_json_schemas_outlines_core_would_misread_are_refused(schema, said):
    with pytest.raises(ConstraintError, match=re.escape(said)) as err:
        to_regex(JsonSchema(schema))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "string"}]}, {"oneOf": [{"enum": [1, 2]}, {"const": 3}]},
    {"allOf": [{"type": "integer"}]}, {"type": "integer", "enum": [1, 2.0]},
    {"type": "object", "properties": {"a": {"type": "string", "format": "date-time"}}, "required": ["a"]},
    {"type": "integer", "format": "int32"}, {"type": "number", "format": "float"},  # OpenAPI's: not a string's
    {"format": "date"}, {"type": ["string", "null"], "format": "email"},
    {"type": "string", "pattern": "(?i)[^ab]+"},  # spelt out, the quote left out: it had taken '"x\\"'
], ids=repr)
def test_json_schemas_outlines_core_reads_right_still_compile(schema):
    assert to_regex(JsonSchema(schema))


def test_a_format_is_ours_where_the_type_is_a_list_holding_string():
    """{"type": ["string", "null"], "format": "date"}: the format is rewritten as for "string"
    alone; outlines-core's own date took any Unicode digit ('"٢٠٢٦-12-05"')."""
    pattern = to_regex(JsonSchema({"type": ["string", "null"], "format": "date"}))
    assert re.fullmatch(pattern, '"2026-12-05"') and re.fullmatch(pattern, "null")
    assert re.fullmatch(pattern, '"\u0662\u0660\u0662\u0666-12-05"') is None


def test_formats_take_real_dates_and_times_only():
    """A date or time answer meets its format as a reader checks it: no month or day 00, no 13th
    month, no 32nd day, no hour 24."""
    from engine.json_schema import FORMATS

    good = {"date": ["2026-12-05", "1999-01-31"], "time": ["00:00:00", "23:59:59Z"],
            "date-time": ["2026-12-05T23:59:59.123Z", "2026-01-01T00:00:00"]}
    bad = {"date": ["2026-00-10", "2026-12-00", "2026-13-01", "2026-12-32"], "time": ["24:00:00", "12:60:00"],
           "date-time": ["2026-00-05T10:00:00", "2026-12-00T10:00:00", "2026-12-05T24:00:00"]}
    for name, values in good.items():
        assert all(re.fullmatch(FORMATS[name], v) for v in values), name
    for name, values in bad.items():
        assert not any(re.fullmatch(FORMATS[name], v) for v in values), name


def test_a_json_schema_nested_deeper_than_outlines_core_reads_says_so():
    """Objects inside objects past 127 levels: outlines-core's JSON reader refused the valid schema
    as "Expected a valid JSON string."; a thousand levels, as a dict or as text, were a
    RecursionError traceback from the API. Each is a ConstraintError saying it is nested too deep;
    127 levels still compile."""
    def nested(levels):  # an object level is two: the schema and its "properties"
        schema = {"type": "integer"}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema

    assert re.fullmatch(to_regex(JsonSchema(nested(63))), '{"a": ' * 63 + "1" + "}" * 63)  # 127 levels
    for deep in (nested(64), '{"type": "array", "items": ' * 2000 + "{}" + "}" * 2000):
        with pytest.raises(ConstraintError, match="^cannot use the JSON schema: it is nested too deep"):
            to_regex(JsonSchema(deep))
    with pytest.raises(ConstraintError, match="^cannot use the JSON schema: it is nested too deep"):
        JsonSchema(nested(2000))
    # arrays inside arrays: outlines-core's regex doubles with each; 100 had taken the process's
    # memory until it was killed (13 build 400 kB in 0.1 s, then seconds of checks)
    deep = {"type": "integer"}
    for _ in range(13):
        deep = {"type": "array", "items": deep}
    for schema in (deep, {"type": "object", "properties": {"a": deep}}):
        with pytest.raises(ConstraintError, match=r"^cannot use the JSON schema: it is nested too deep \(arrays inside arrays, over 12 levels"):
            to_regex(JsonSchema(schema))
    assert to_regex(JsonSchema(deep["items"]["items"]))  # 11 deep: built, as before


def test_a_date_format_takes_the_days_that_exist_only():
    """`date.fromisoformat` (jsonschema's date check) refuses 31 September and 29 February of a
    year that is not a leap year, which the format took: every day of every month of years
    around each rule (leap, plain, century, fourth century), and 29 February of every year."""
    from engine.json_schema import FORMATS

    def exists(y: int, m: int, d: int) -> bool:
        try:
            return bool(date(y, m, d))
        except ValueError:
            return False

    days = [(y, m, d) for y in (1, 4, 1900, 1996, 2000, 2023, 2024, 2026, 2100, 2400, 9999)
            for m in range(0, 14) for d in range(0, 33)] + [(y, 2, 29) for y in range(1, 10000)]
    for name, tail in [("date", ""), ("date-time", "T10:00:00Z")]:
        pattern = re.compile(FORMATS[name])
        wrong = [(y, m, d) for y, m, d in days if bool(pattern.fullmatch(f"{y:04d}-{m:02d}-{d:02d}{tail}")) != exists(y, m, d)]
        assert not wrong, (name, wrong[:5])
    assert re.fullmatch(FORMATS["date"], "0000-02-29")  # year 0 is a leap year (RFC 3339); Python has no year 0
    assert not re.fullmatch(FORMATS["date-time"], "12026-01-01T00:00:00")  # RFC 3339's year has four digits


def test_a_strings_format_or_pattern_cannot_end_the_json_string(small_folder):
    """outlines-core's time format wanted a backslash before its fraction ('"13:55:17\\,69"', which
    json.loads refuses), its date any Unicode digit, and a pattern's `.` took a quote: every
    answer now parses, and its string meets the format or the pattern."""
    schemas = {"time": (r"(2[0-3]|[01][0-9]):[0-5][0-9]:[0-5][0-9]Z?", {"type": "string", "format": "time"}),
               "date": (r"[0-9]{4}-[01][0-9]-[0-3][0-9]", {"type": "string", "format": "date"}),
               "email": (r"[^@\s]+@[^@\s]+\.[a-z0-9]+", {"type": "string", "format": "email"}),
               "any": (r"[^\"\\\x00-\x1f]{1,6}", {"type": "string", "pattern": "^.{1,6}$"})}
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        for name, (meets, schema) in schemas.items():
            constraint = JsonSchema({"type": "object", "properties": {"t": schema}, "required": ["t"]})
            handles = [eng.submit(IMAGES[seed % 3], question="When?", constraint=constraint,
                                  params=SamplingParams(temperature=1.5, top_p=1.0, seed=seed, max_tokens=60))
                       for seed in range(12)]
            for h in handles:
                out = h.result(60)
                if out.finish_reason == "stop":
                    value = json.loads(out.text)["t"]
                    assert re.fullmatch(meets, value), (name, out.text)


def test_python_and_outlines_core_read_each_class_alike():
    """outlines-core reads `\\d`, `\\w`, `\\s` with Rust's definitions and Unicode 16, Python 3.11
    with its own and Unicode 14: `\\d+` answered '$272꘦\U0001ccf6.27', which Python's re refuses.
    Printed again, a class lets through only what both read in it."""
    from engine.regex_text import for_outlines

    chars = ["1", "a", "_", " ", "\x1c", "\u0663", "\U0001ccf6", "\u0301", "\u203f", "\u00bd", "\u00e9", "\u2028",
             "-", "\U000e0100", "\u0378"]
    vocab = Vocabulary(0, {c.encode(): [i + 1] for i, c in enumerate(chars)})
    for pattern in [r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", r"[\w-]", r"[^\d]", r"[^\w\s]", r"[\W_]", r"."]:
        ours, theirs = Index(for_outlines(pattern), vocab), Index(pattern, vocab)
        allowed = {chars[t - 1] for t in ours.get_allowed_tokens(ours.get_initial_state()) if t}
        outlines = {chars[t - 1] for t in theirs.get_allowed_tokens(theirs.get_initial_state()) if t}
        python = {c for c in chars if re.fullmatch(pattern, c)}
        assert allowed <= python & outlines, (pattern, allowed - python, allowed - outlines)
        ascii_both = {c for c in python & outlines if c.isascii()}
        assert ascii_both <= allowed, pattern  # nothing plain is lost
    assert re.fullmatch(for_outlines(r"[0-9a-f]{2}"), "0b") and for_outlines("^colou?r$") == "colo(?:u){0,1}r"
    # case folding is spelt out too: Rust's own (?i) folds by Unicode 16, and (?a) does not stop it
    folded = ["k", "K", "\u212a", "\u00e9", "\u00c9", "a", "A", "b", "\u019b", "\ua7dc", "\u017f", "s", "S"]
    vocab = Vocabulary(0, {c.encode(): [i + 1] for i, c in enumerate(folded)})
    for pattern in ["(?i)k", "(?ai)k", "(?ai)\u00e9", "(?ai)[\u00e9-\u00ea]", "(?i)[^a]", "(?i:\u019b)", "(?ai)[\u017fs]",
                    "(?i)[a-c]"]:
        index = Index(for_outlines(pattern), vocab)
        allowed = {folded[t - 1] for t in index.get_allowed_tokens(index.get_initial_state()) if t}
        assert allowed <= {c for c in folded if re.fullmatch(pattern, c)}, (pattern, allowed)
        assert allowed, pattern  # each matches something here


def test_a_regex_not_in_pythons_syntax_is_refused():
    """Answers are checked with Python's re: `\\p{L}+` compiled and answered '𖩥', which no Python
    check could read."""
    for pattern in (r"\p{L}+", r"[0-9]+\z", "(?<n>ab)"):
        with pytest.raises(ConstraintError, match="not in Python's syntax"):
            to_regex(Regex(pattern))


def test_anchors_at_the_ends_are_dropped_and_anchors_inside_said_as_such():
    """`^...$` and `\\A...\\Z` at the ends: the answer matches the whole pattern anyway. An anchor
    inside (in a branch, around a word) is a ConstraintError that names it, not a failed index."""
    for pattern in (r"^[0-9]+$", r"\A[0-9]+\Z", r"\A[0-9]+$"):
        assert re.fullmatch(to_regex(Regex(pattern)), "123"), pattern
    for pattern in ("(a|^b)c", r"\bred\b", r"(x(a$|b))c"):
        with pytest.raises(ConstraintError, match="has an anchor"):
            to_regex(Regex(pattern))


def test_an_escaped_backslash_before_the_end_is_not_an_anchor():
    """`a\\\\Z` is an a, a backslash and a Z: its `\\Z` had been taken for the end anchor and cut
    off, and the rest (`a\\`) refused as not in Python's syntax. `\\$` was already told apart."""
    for pattern, answer in ((r"a\\Z", "a\\Z"), (r"a\\\Z", "a\\"), (r"a\\$", "a\\"), (r"a\\\$", "a\\$")):
        assert re.fullmatch(to_regex(Regex(pattern)), answer), pattern
        assert re.fullmatch(pattern, answer), pattern


def test_constraints_of_the_wrong_type_are_constraint_errors():
    with pytest.raises(ConstraintError, match="must be a string"):
        Regex(None)
    with pytest.raises(ConstraintError, match="must be a string"):
        Regex(b"[0-9]")
    with pytest.raises(ConstraintError, match="not one string"):
        Choice("yes")  # had become the choices y, e, s
    with pytest.raises(ConstraintError, match="dict or a JSON string"):
        JsonSchema({"type", "integer"})


def test_a_pattern_printed_for_outlines_core_matches_nothing_python_would_refuse():
    """Random patterns over classes, groups, branches, repeats (lazy too) and case folding, and
    random strings with letters of other scripts, marks and separators: what the printed pattern
    matches Python's pattern matches too (JSON strings: never a quote, backslash or control
    character), and plain ASCII text it matches alike (bar \\x1c-\\x1f, which Rust's \\s lacks)."""
    import random

    from engine.regex_text import for_outlines

    atoms = ["a", "b", r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", ".", "[a-c]", "[^a-c]", r"[\d_]", r"[^\w]", r"\.",
             r"\$", "[ab-]", "é", "(?i:a)", "(?i:[a-c])", r"[\W\d]", r"\n", "x?", "(?i:[^a])", "(?i:[^\\d_])", "(?i:k)"]
    rng = random.Random(0)

    def pattern(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice(atoms)
        if r < 0.6:
            return pattern(depth + 1) + pattern(depth + 1)
        if r < 0.75:
            return f"({pattern(depth + 1)}|{pattern(depth + 1)})"
        return f"(?:{pattern(depth + 1)})" + rng.choice(["*", "+", "?", "{1,3}", "{2}", "*?", "{0,2}?"])

    alphabet = 'ab c1_.-$é\n\t\u0663\u0301\x1c\u00bdK"\\AkK\u212a\u017fS'
    for _ in range(300):
        p = pattern()
        ours = for_outlines(p)
        try:
            in_json = for_outlines(p, json_string=True)
        except ValueError:  # a literal a JSON string cannot hold (\n): refused
            in_json = None
        for _ in range(20):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))
            python, printed = re.fullmatch(p, s) is not None, re.fullmatch(ours, s) is not None
            assert python or not printed, (p, s)
            if s.isascii() and not any("\x1c" <= c <= "\x1f" for c in s):
                assert python == printed, (p, s)
            if in_json is not None and re.fullmatch(in_json, s):
                assert python and not any(c in '"\\' or ord(c) < 0x20 for c in s), (p, s)


def test_a_choice_allows_its_options_as_written_not_read_as_regexes():
    """Choice(["1+1", "3.5", "(yes)", "a|b"]): each option is a string; read as a regex they had
    allowed '111', '3x5', 'yes' and 'a' as answers."""
    options = ["1+1", "3.5", "(yes)", "a|b"]
    pattern = to_regex(Choice(options))
    assert all(re.fullmatch(pattern, o) for o in options)
    assert not any(re.fullmatch(pattern, o) for o in ["111", "3x5", "yes", "a", "b"])


@pytest.mark.parametrize("constraint", [Regex("[a-z ]*"), Regex("(no )*yes"), Choice(["yes", "no"])], ids=repr)
def test_the_mask_in_every_state_reached_is_outlines_cores(small, constraint):
    """The device automaton allows, in each state, exactly the tokens outlines-core's index does
    (EOS in final states): a token wrongly masked changes the answer (in a pattern that comes back
    to its first state, `[a-z ]*`, every answer was ''), one wrongly allowed breaks the constraint."""
    from collections import deque

    import torch

    eos, vocab_size = small.config.tokenizer.eos_id, small.config.text.vocab_size
    automaton = compile_constraint(constraint, small.tokenizer, vocab_size, eos, small.device)
    index = Index(to_regex(constraint), Vocabulary(eos, token_bytes(small.tokenizer, vocab_size, eos)))
    seen, todo = {0}, deque([(0, index.get_initial_state())])
    while todo:
        ours, theirs = todo.popleft()
        allowed = set(torch.nonzero(automaton.allowed(torch.tensor([ours], device=small.device))[0]).flatten().tolist())
        assert allowed == set(index.get_allowed_tokens(theirs)), (constraint, ours)
        for t in sorted(allowed - {eos}):
            nxt = int(automaton.advance(torch.tensor([ours], device=small.device),
                                        torch.tensor([t], device=small.device))[0])
            if nxt not in seen:
                seen.add(nxt)
                todo.append((nxt, index.get_next_state(theirs, t)))
    assert len(seen) > 1


def test_a_flag_turned_off_inside_a_group_stays_off_in_the_pattern_printed():
    """`(?i)a(?-i:b)`: Python matches the b in lower case only; printed with the outer flag, it
    allowed 'AB', which Python's check refuses."""
    from engine.regex_text import for_outlines

    printed = for_outlines("(?i)a(?-i:b)c")
    assert re.fullmatch(printed, "AbC") and re.fullmatch("(?i)a(?-i:b)c", "AbC")
    assert re.fullmatch(printed, "aBc") is None


@pytest.mark.parametrize("pattern, other_case",
                         [("(?i)[^s]+", "\u017f"), ("(?i)[^sx]+", "\u017f"), ("(?i)[^ix]+", "\u0131"),
                          ("(?i)[^i]+", "\u0130")])  # a dotted capital I: two characters in lower case
def test_a_class_that_forbids_a_letter_under_ignorecase_forbids_every_case_python_matches_it_with(pattern,
                                                                                                  other_case):
    """`(?i)[^s]+`: Python's re reads the long s (U+017F) as an s, and the dotless i as an i; the
    pattern printed for outlines-core must refuse them too, or an answer it allows fails the check."""
    from engine.regex_text import for_outlines

    assert re.fullmatch(pattern, other_case) is None  # as Python reads it
    assert re.fullmatch(for_outlines(pattern), other_case) is None
    assert re.fullmatch(for_outlines(pattern), "abc")


def test_compiles_run_at_most_max_children_at_once(monkeypatch):
    """Each web page or API call submits in its own thread: slow patterns sent together had
    started a compiler child each (a core and up to 4 GB apiece, for 30 s). Now the others wait."""
    import pickle
    import threading

    import engine.index_child as index_child

    lock, release = threading.Lock(), threading.Event()
    running, peak = [0], [0]

    class Child:
        returncode = 0

        def __init__(self, *args, **kwargs):
            pass

        def communicate(self, input=None, timeout=None):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            release.wait(30)
            with lock:
                running[0] -= 1
            return pickle.dumps((0, {}, set())), b""

    monkeypatch.setattr(index_child.subprocess, "Popen", Child)
    done = []
    threads = [threading.Thread(target=lambda: done.append(index_child.build("a", 0, {b"a": [1]})))
               for _ in range(6)]
    for t in threads:
        t.start()
    # the limit's two running first (a loaded machine may start the threads slowly: a fixed 2 s
    # from here could see only one, and fail "1 compiles at once"), then 2 s more for others
    started = time.monotonic() + 30
    while time.monotonic() < started and running[0] < 2:
        time.sleep(0.02)
    deadline = time.monotonic() + 2.0  # all six at once without the limit; never with it
    while time.monotonic() < deadline and running[0] < len(threads):
        time.sleep(0.02)
    release.set()
    for t in threads:
        t.join(30)
    assert len(done) == len(threads)
    assert peak[0] == 2, f"{peak[0]} compiles at once"  # MAX_CHILDREN


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork only")
def test_a_fork_while_constraints_compile_leaves_the_child_its_turns():
    """The parent's compiles held both turns at the fork: their threads do not run in the child,
    which had waited for ever on its first compile (an Engine made there, as a fork is told to)."""
    from engine import index_child

    for _ in range(index_child.MAX_CHILDREN):  # as compiles under way in other threads would
        index_child._turns.acquire()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                os.write(write, b"1" if index_child._turns.acquire(timeout=2) else b"0")
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            said = f.read()
        os.waitpid(pid, 0)
        assert said == b"1"
    finally:
        for _ in range(index_child.MAX_CHILDREN):
            index_child._turns.release()
