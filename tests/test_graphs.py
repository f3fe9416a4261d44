"""Decode graphs: the static, bucketed decode step that CUDA graphs replay, checked eagerly on CPU.

Padding rows (scratch page, dummy token slot, length 1) must not change the real rows' tokens,
whatever the bucket; on CUDA the same step is captured and replayed (scripts/gpu_check.py).
"""

import numpy as np
import pytest

import engine.engine as engine_module
from engine import Engine, EngineConfig, SamplingParams
from engine.errors import ConfigError
from engine.graphs import DecodeGraphs, buckets


def test_buckets_cover_every_batch_size():
    assert buckets(32) == [1, 2, 4, 8, 16, 32]
    assert buckets(24) == [1, 2, 4, 8, 16, 24]
    assert buckets(1) == [1]
    g = DecodeGraphs(lambda *a: None, 24, 4, pad_slot=24, scratch_page=99, page_size=16, device=None, capture=False)
    assert [g.bucket(b) for b in (1, 2, 3, 5, 16, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    with pytest.raises(ValueError):
        g.bucket(25)


def test_host_inputs_pad_to_the_bucket():
    g = DecodeGraphs(lambda *a: None, 8, 4, pad_slot=8, scratch_page=50, page_size=16, device=None, capture=False)
    n, packed = g.host_inputs([3, 5, 6], np.array([90, 17, 40]), np.array([700, 801, 902]), [[7, 8, 9], [4], [1, 2]])
    assert n == 4
    slots, pos, write, lens = (packed[i * 4:(i + 1) * 4].tolist() for i in range(4))
    pages = packed[16:].reshape(4, 4).tolist()
    assert slots == [3, 5, 6, 8] and pos == [90, 17, 40, 0] and write == [700, 801, 902, 800]
    assert lens == [91, 18, 41, 1]
    assert pages == [[7, 8, 9, 50], [4, 50, 50, 50], [1, 2, 50, 50], [50, 50, 50, 50]]


def _run(images, params, static: bool, monkeypatch) -> list[list[int]]:
    if static:
        monkeypatch.setattr(engine_module, "graph_mode", lambda flag, device: "static")
    with Engine(EngineConfig(model="tiny", max_batch_size=8)) as engine:
        handles = [engine.submit(img, caption="short", params=p) for img, p in zip(images, params)]
        handles.append(engine.submit(images[0], question="How many shapes are there?", params=params[0]))
        out = [h.result(timeout=300).token_ids for h in handles]
    assert engine.stats().kv_pages_in_use == 0  # after close: every page back, scratch page unused
    monkeypatch.undo()
    return out


def test_static_decode_gives_the_eager_tokens(monkeypatch):
    rng = np.random.default_rng(4)
    images = [rng.integers(0, 255, (150, 200, 3), dtype=np.uint8) for _ in range(5)]  # 6 rows: bucket 8
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=i, max_tokens=12) for i in range(5)]
    assert _run(images, params, True, monkeypatch) == _run(images, params, False, monkeypatch)


def test_drafts_in_graphs_and_past_the_largest_bucket(monkeypatch):
    # A draft step of up to 8 rows runs in a decode graph, its draft tokens fed through the
    # token table; one of more rows than the largest graph runs eagerly. Same tokens either way.
    monkeypatch.setattr(engine_module, "graph_mode", lambda flag, device: "static")
    img = np.random.default_rng(7).integers(0, 255, (150, 200, 3), dtype=np.uint8)
    p = SamplingParams(max_tokens=16)
    with Engine(EngineConfig(model="tiny", max_batch_size=8, max_draft=3)) as small, \
            Engine(EngineConfig(model="tiny", max_batch_size=8, max_draft=16)) as large:
        for engine in (small, large):
            plain = engine.submit(img, caption="normal", params=p).result(timeout=300).token_ids
            steps = engine.stats().steps
            drafted = engine.submit(img, caption="normal", params=p, draft=plain).result(timeout=300).token_ids
            assert drafted == plain and engine.stats().draft_accepted > 0
            assert engine.stats().steps - steps < steps / 2
    assert small.stats().kv_pages_in_use == 0 and large.stats().kv_pages_in_use == 0


def test_cuda_graphs_need_cuda():
    with pytest.raises(ConfigError, match="CUDA"):
        Engine(EngineConfig(model="tiny", cuda_graphs=True))


def test_vision_graphs_pad_crops_without_changing_the_real_ones():
    import torch

    from engine.graphs import VisionGraphs
    from engine.models.loader import load_model

    model = load_model("tiny").model
    vc = model.config.vision
    vg = VisionGraphs(model.vision.encode, 8, (3, vc.crop_size, vc.crop_size), torch.float32, torch.device("cpu"),
                      capture=False)
    crops = torch.rand(3, 3, vc.crop_size, vc.crop_size) * 2 - 1
    with torch.inference_mode():
        eager = model.vision.encode(crops)
        vg.run(torch.rand(4, 3, vc.crop_size, vc.crop_size))  # an earlier step leaves other crops behind
        static = vg.run(crops)
        big = vg.run(torch.rand(9, 3, vc.crop_size, vc.crop_size))  # past the largest bucket: eager
    assert static.shape == eager.shape and sorted(vg._static) == [4]
    assert torch.allclose(static, eager, atol=1e-5, rtol=1e-5)
    assert big.shape[0] == 9
