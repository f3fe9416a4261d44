import json
import re

import numpy as np
import pytest
from outlines_core import Index, Vocabulary

import engine.constraints as constraints_module
from engine import Choice, ConstraintError, Engine, EngineConfig, JsonSchema, Regex, SamplingParams
from engine.constraints import compile_constraint, to_regex, token_bytes
from engine.models.loader import load_model
from engine.reference import ReferenceDecoder

IMAGES = [np.random.default_rng(i).integers(0, 256, size=(60, 80, 3), dtype=np.uint8) for i in range(3)]
SCHEMA = {"type": "object", "properties": {"shape": {"type": "string", "enum": ["circle", "star"]},
                                          "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["shape", "count"]}
CONSTRAINTS = [Regex(r"(red|green|blue) (circle|square|star)"), Choice(["yes", "no", "maybe not"]),
               JsonSchema(SCHEMA), Regex(r"[0-9]{1,3}")]


def _valid(constraint, text):
    if isinstance(constraint, Regex):
        return re.fullmatch(constraint.pattern, text) is not None
    if isinstance(constraint, Choice):
        return text in constraint.options
    obj = json.loads(text)
    return set(obj) == {"shape", "count"} and obj["shape"] in ("circle", "star") and isinstance(obj["count"], int)


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


def test_sparse_automaton_equals_dense(small, monkeypatch):
    c = JsonSchema(SCHEMA)
    dense = compile_constraint(c, small.tokenizer, small.config.text.vocab_size, 0, small.device)
    monkeypatch.setattr(constraints_module, "DENSE_LIMIT", 0)
    sparse = compile_constraint(c, small.tokenizer, small.config.text.vocab_size, 0, small.device)
    assert dense.dense and not sparse.dense
    import torch

    states = torch.arange(dense.n_states)
    assert torch.equal(dense.allowed(states), sparse.allowed(states))
    for t in range(0, small.config.text.vocab_size, 7):
        tok = torch.full_like(states, t)
        ok = dense.allowed(states)[:, t]
        assert torch.equal(dense.advance(states, tok)[ok], sparse.advance(states, tok)[ok])


@pytest.mark.parametrize("bad", [Regex("(unclosed"), Choice([]), JsonSchema('{"type": "nonsense"}'),
                                 "not a constraint", Regex("a{3,1}")])
def test_constraints_that_cannot_compile(small_folder, bad):
    with Engine(EngineConfig(model=str(small_folder))) as eng:
        with pytest.raises(ConstraintError):
            eng.submit(IMAGES[0], question="x?", constraint=bad)
        assert eng.submit(IMAGES[0], caption="short", params=SamplingParams(max_tokens=3)).result(30)
