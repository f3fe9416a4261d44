"""Triton kernels against their PyTorch references, on CPU through Triton's interpreter.

Inputs are fresh random draws each run (the seed is in the assertion message); shapes are tiny so
each launch stays under ~100 program instances. Outputs are poisoned first, so an element a
kernel forgets to write is caught.
"""

import importlib
import os
import random
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, Regex, SamplingParams
from engine.errors import ConfigError


@pytest.fixture(scope="module")
def kernels():
    # conftest sets TRITON_INTERPRET=1 before anything imports triton (Triton's own @jit helpers
    # such as tl.sum are decorated once, at its first import).
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels run on a GPU here; these tests are for Triton's interpreter")
    return {name: importlib.import_module(f"engine.kernels.{name}") for name in ("kv_write", "paged_attention", "sampling")}


def _seed() -> int:
    return random.SystemRandom().randrange(1 << 31)


@pytest.mark.parametrize("heads,kv_heads,dtype", [(4, 2, torch.float32), (2, 2, torch.float32),
                                                  (4, 1, torch.bfloat16)])
def test_paged_attention_matches_reference(kernels, heads, kv_heads, dtype):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    mod = kernels["paged_attention"]
    B, D, PS, n_pages = 5, 16, 4, 24
    k = torch.randn(n_pages * PS, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(n_pages * PS, kv_heads, D, generator=g).to(dtype)
    lens = torch.randint(1, 6 * PS + 1, (B,), generator=g)
    lens[0] = 1  # a single key
    lens[1] = 6 * PS  # whole pages
    table = torch.stack([torch.randperm(n_pages, generator=g)[:6] for _ in range(B)])
    q = torch.randn(B, heads, D, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    got = mod.paged_attention_triton(q, k, v, table, lens, PS, D ** -0.5, out=out)
    want = mod.paged_attention_reference(q, k, v, table, lens, PS, D ** -0.5)
    assert not torch.isnan(got).any(), f"unwritten outputs (seed {seed})"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), f"seed {seed}"


def test_paged_attention_ignores_pages_past_the_length(kernels):
    mod = kernels["paged_attention"]
    D, PS = 16, 4
    k = torch.randn(8 * PS, 1, D)
    v = torch.randn(8 * PS, 1, D)
    q = torch.randn(1, 1, D)
    table = torch.tensor([[2, 5, 7]])
    a = mod.paged_attention_triton(q, k, v, table, torch.tensor([5]), PS, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[7 * PS:], v2[7 * PS:] = float("nan"), float("nan")  # the third page is past the length
    k2[5 * PS + 1:6 * PS] = float("nan")  # so is the second page beyond its first slot
    b = mod.paged_attention_triton(q, k2, v2, table, torch.tensor([5]), PS, 0.25)
    assert torch.equal(a, b)


def test_kv_write_matches_reference_and_touches_nothing_else(kernels):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    mod = kernels["kv_write"]
    n_slots, hk, D = 64, 2, 16
    cache_k = torch.full((n_slots, hk, D), float("nan"))
    cache_v = torch.full((n_slots, hk, D), float("nan"))
    slots = torch.randperm(n_slots, generator=g)[:9]
    k_new, v_new = torch.randn(9, hk, D, generator=g), torch.randn(9, hk, D, generator=g)
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    mod.kv_write_triton(cache_k, cache_v, k_new, v_new, slots)
    mod.kv_write_reference(ref_k, ref_v, k_new, v_new, slots)
    assert torch.equal(cache_k.nan_to_num(7.0), ref_k.nan_to_num(7.0)), f"seed {seed}"
    assert torch.equal(cache_v.nan_to_num(7.0), ref_v.nan_to_num(7.0)), f"seed {seed}"
    assert torch.equal(cache_k[slots], k_new)


def _acceptable(ref_mod, logits, allowed, sup, temp, top_p, u, eps=1e-5) -> set[int]:
    """Tokens the reference picks for one row when u and top_p move by float-rounding amounts."""
    out = set()
    for du in (-eps, 0.0, eps):
        for dp in (-eps, 0.0, eps):
            out.add(int(ref_mod.sample_reference(logits[None], None if allowed is None else allowed[None], sup[None], 3,
                                                 temp[None], (top_p + dp)[None], (u + du).clamp(0, 1 - 1e-7)[None])[0]))
    return out


@pytest.mark.parametrize("constrained", [False, True])
def test_fused_sampling_matches_reference(kernels, constrained):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    mod = kernels["sampling"]
    R, V = 12, 203  # not a multiple of the block: the tail is masked (12 rows in 2 blocks: the interpreter
    # takes 2 s a launch, against 11 s for 24 rows in 4 blocks)
    logits = torch.randn(R, V, generator=g) * torch.rand(R, 1, generator=g) * 6
    logits[3, 10:20] = logits[3, 10]  # ties
    allowed = (torch.rand(R, V, generator=g) > 0.6).to(torch.uint8) if constrained else None
    if constrained:
        allowed[:, 3] = 1
        allowed[5] = 0
        allowed[5, 3] = 1
        allowed[5, 100] = 1  # the answer marker is suppressed below: 100 is the only choice
    sup = torch.rand(R, generator=g) > 0.5
    sup[5] = True
    temp = torch.rand(R, generator=g) * 1.5
    temp[:4] = 0.0  # greedy rows
    top_p = torch.rand(R, generator=g)
    top_p[4:8] = 1.0
    u = torch.rand(R, generator=g)
    out = torch.full((R,), -1, dtype=torch.int64)
    got = mod.sample_triton(logits, allowed, sup, 3, temp, top_p, u, block=128, out=out)
    want = mod.sample_reference(logits, allowed, sup, 3, temp, top_p, u)
    assert (got >= 0).all(), f"unwritten rows (seed {seed})"
    assert torch.equal(got[:4], want[:4]), f"greedy rows differ (seed {seed})"
    if constrained:
        assert got[5] == 100
        assert all(allowed[r, got[r]] for r in range(R)), f"a disallowed token (seed {seed})"
    for r in range(R):
        ok = _acceptable(mod, logits[r], None if allowed is None else allowed[r], sup[r], temp[r], top_p[r], u[r])
        assert int(got[r]) in ok, f"row {r}: kernel {int(got[r])}, reference {ok} (seed {seed})"
    assert torch.equal(mod.sample_triton(logits, allowed, sup, 3, temp, top_p, u, block=128), got)  # deterministic


def test_engine_with_kernels_gives_the_tokens_of_the_torch_path(kernels):
    shape = Regex(r"(red|green|blue) (circle|square|star)")
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 255, (120, 160, 3), dtype=np.uint8) for _ in range(2)]
    params = [SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6)]
    outs = {}
    for flag in (False, True):
        with Engine(EngineConfig(model="tiny", triton_kernels=flag, max_batch_size=4)) as engine:
            handles = [engine.submit(img, caption="short", params=p) for img, p in zip(images, params)]
            handles.append(engine.submit(images[0], question="What color is the circle?", params=params[0]))
            # sticky rows: the preferred token is read off the logits after the sampling kernel
            draft = engine.loaded.tokenizer.encode("a red circle and a small blue star")
            handles.append(engine.submit(images[1], caption="short", draft=draft,
                                         params=SamplingParams(max_tokens=6, sticky=3.0)))
            # constrained rows: the automaton's mask reaches the kernel (`constraint_mask`)
            for p in params:
                handles.append(engine.submit(images[0], question="What is it?", constraint=shape,
                                             params=replace(p, max_tokens=12)))
            results = [h.result(timeout=300) for h in handles]
            outs[flag] = [r.token_ids for r in results]
        assert engine.stats().kv_pages_in_use == 0
        assert all(re.fullmatch(shape.pattern, r.text) for r in results[-2:]), [r.text for r in results[-2:]]
    assert outs[True] == outs[False]


def test_kernels_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        Engine(EngineConfig(model="tiny", triton_kernels=True))
