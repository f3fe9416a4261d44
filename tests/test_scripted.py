"""The TorchScript step forward (CPU): bit-identical to the eager step, and a safe fallback."""

import warnings

import numpy as np
import pytest
import torch

import engine.scripted as scripted
from engine import Engine, EngineConfig, SamplingParams
from engine.device import script_mode
from engine.errors import ConfigError
from engine.models.loader import load_model
from engine.models.tiling import normalize_crops
from engine.runner import Runner


NONE = torch.zeros(0, dtype=torch.int64)


def fused_decode(runner: Runner, slots, pos, write, pages, mask) -> torch.Tensor:
    """The logits of decode rows alone through the one-call step forward."""
    b = len(slots)
    inputs = (pos.reshape(-1), write, NONE, NONE, [[b, 1]], [pages], [mask], torch.arange(b))
    return runner._fused([], NONE, inputs, slots)[1]


def fused_hidden(runner: Runner, x, pos, write, pages, mask) -> torch.Tensor:
    """The hidden states of one prefill group (given its inputs) through the one-call step forward."""
    b, t, c = x.shape
    inputs = (pos.reshape(-1), write, NONE, NONE, [[b, t]], [pages], [mask], NONE)
    return runner._fused([x.reshape(-1, c)], NONE, inputs)[0].view(b, t, c)


def _step_inputs(runner: Runner, b: int, rng: np.random.Generator):
    """A decode step of b rows at random positions over random, partly shared pages."""
    ps, n_pages = runner.page_size, runner.k.shape[1] // runner.page_size
    positions = rng.integers(3, runner.config.text.max_context - 1, size=b)
    n_ctx = int(-(-(positions.max() + 1) // 16) * 16)
    tables = [rng.choice(n_pages, size=n_ctx // ps, replace=False) for _ in range(b)]
    write = np.array([t[p // ps] * ps + p % ps for t, p in zip(tables, positions)])
    slots = torch.as_tensor(rng.permutation(runner.last_token.shape[0] - 1)[:b])
    pos = torch.as_tensor(positions)[:, None]
    mask = (torch.arange(n_ctx)[None, :] <= pos)[:, None, None, :]
    return slots, pos, torch.as_tensor(write), torch.as_tensor(np.stack(tables)), mask


@pytest.mark.parametrize("gqa,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_scripted_decode_is_bit_identical_to_the_eager_step(gqa, dtype, small_folder, gqa_folder):
    loaded = load_model(gqa_folder if gqa else small_folder, dtype=dtype)
    runner = Runner(loaded, n_pages=40, page_size=16, max_batch=8, executor=None, script=True)
    assert runner.scripted is not None
    text = loaded.model.text
    rng = np.random.default_rng(7)
    with torch.inference_mode():
        runner.k.copy_(torch.randn(runner.k.shape))
        runner.v.copy_(torch.randn(runner.v.shape))
        runner.last_token.copy_(torch.as_tensor(rng.integers(0, loaded.config.text.vocab_size, size=runner.last_token.shape[0])))
        for b in (1, 3, 8):
            slots, pos, write, pages, mask = _step_inputs(runner, b, rng)
            k0, v0 = runner.k.clone(), runner.v.clone()
            h = text(text.embed(runner.last_token[slots])[:, None], pos, runner._attend(write, pages, mask))
            eager, k_eager, v_eager = text.logits(h[:, -1]), runner.k.clone(), runner.v.clone()
            runner.k.copy_(k0)
            runner.v.copy_(v0)
            got = fused_decode(runner, slots, pos, write, pages, mask)
            assert got.dtype == eager.dtype and torch.equal(got, eager), b
            assert torch.equal(runner.k, k_eager) and torch.equal(runner.v, v_eager)  # same KV writes
            assert not torch.equal(runner.k, k0)  # and there were some


@pytest.mark.parametrize("gqa,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_scripted_prefill_is_bit_identical_to_the_eager_one(gqa, dtype, small_folder, gqa_folder):
    """Prompt chunks (causal) and image prefixes (bidirectional): exact fp64 attention in fp32."""
    loaded = load_model(gqa_folder if gqa else small_folder, dtype=dtype)
    runner = Runner(loaded, n_pages=40, page_size=16, max_batch=8, executor=None, script=True)
    assert runner.exact == (dtype == torch.float32)
    text, ps = loaded.model.text, runner.page_size
    rng = np.random.default_rng(3)
    with torch.inference_mode():
        runner.k.copy_(torch.randn(runner.k.shape))
        runner.v.copy_(torch.randn(runner.v.shape))
        for b, t, start, bidirectional in ((1, 5, 20, False), (3, 7, 9, False), (2, 30, 0, True)):
            n_ctx = int(-(-(start + t) // 16) * 16)
            tables = np.stack([rng.choice(40, size=n_ctx // ps, replace=False) for _ in range(b)])
            positions = np.arange(start, start + t)[None].repeat(b, 0)
            write = torch.as_tensor(np.concatenate([tab[p // ps] * ps + p % ps for tab, p in zip(tables, positions)]))
            if bidirectional:
                mask = (torch.arange(n_ctx) < t).expand(t, n_ctx)[None, None]
            else:
                mask = torch.as_tensor(np.arange(n_ctx)[None, None, :] <= positions[:, :, None])[:, None]
            x = torch.randn(b, t, loaded.config.text.dim).to(dtype)
            pos, pages = torch.as_tensor(positions), torch.as_tensor(tables)
            k0, v0 = runner.k.clone(), runner.v.clone()
            eager = text(x, pos, runner._attend(write, pages, mask))
            k_eager, v_eager = runner.k.clone(), runner.v.clone()
            runner.k.copy_(k0)
            runner.v.copy_(v0)
            got = fused_hidden(runner, x, pos, write, pages, mask)
            assert torch.equal(got, eager), (b, t)
            assert torch.equal(runner.k, k_eager) and torch.equal(runner.v, v_eager)


@pytest.mark.parametrize("gqa,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
def test_scripted_vision_encoder_is_bit_identical_to_the_eager_one(gqa, dtype, small_folder, gqa_folder):
    loaded = load_model(gqa_folder if gqa else small_folder, dtype=dtype)
    vision, vc = loaded.model.vision, loaded.config.vision
    runner = Runner(loaded, n_pages=8, page_size=16, max_batch=2, executor=None, script=True)
    for n_crops in (1, 5):
        crops = (torch.rand(n_crops, vc.in_channels, vc.crop_size, vc.crop_size) * 2 - 1).to(dtype)
        with torch.inference_mode():
            eager = vision.encode(crops)
            got = runner.scripted.vision(crops, runner.vision_weights, vc.enc_n_layers, vc.enc_n_heads,
                                         vc.enc_patch_size)
        assert got.dtype == eager.dtype and torch.equal(got, eager), n_crops


def test_engine_tokens_do_not_depend_on_the_script(gqa_folder, rgb_image):
    params = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10)]
    out = []
    for script in (True, False):
        with Engine(EngineConfig(model=str(gqa_folder), cpu_script=script)) as engine:
            assert (engine.runner.scripted is not None) == script
            handles = [engine.submit(rgb_image, caption="short", params=p) for p in params]
            handles.append(engine.submit(rgb_image, question="What is it?", params=params[1]))
            out.append([h.result(timeout=120).token_ids for h in handles])
    assert out[0] == out[1]


def test_script_mode_is_cpu_only_and_excludes_triton_kernels():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert script_mode(None, cpu, kernels=False) and not script_mode(None, cpu, kernels=True)
    assert not script_mode(None, cuda, kernels=True) and not script_mode(False, cpu, kernels=False)
    with pytest.raises(ConfigError, match="CPU"):
        script_mode(True, cuda, kernels=False)
    with pytest.raises(ConfigError, match="exclude"):
        script_mode(True, cpu, kernels=True)


def test_a_torch_that_cannot_script_decodes_eagerly(monkeypatch, small_folder, rgb_image):
    tries = []

    def refuse(fn):
        tries.append(fn)
        raise RuntimeError("TorchScript is not available in this build")

    monkeypatch.setattr(scripted, "_SCRIPTED", None)
    monkeypatch.setattr(scripted, "_FAILED", False)
    monkeypatch.setattr(torch.jit, "script", refuse)
    with pytest.warns(UserWarning, match="decoding eagerly: TorchScript is not available"):
        engine = Engine(EngineConfig(model=str(small_folder), cpu_script=True))
    with engine:
        assert engine.runner.scripted is None
        out = engine.submit(rgb_image, caption="short", params=SamplingParams(max_tokens=5)).result(timeout=60)
    assert out.finish_reason in ("stop", "length") and out.token_ids
    # tried once a process: a later engine (a model reload) neither compiles again nor warns again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scripted.scripted() is None
    assert len(tries) == 1


def test_warm_up_runs_on_a_scratch_cache_once(monkeypatch, small_folder):
    calls = []
    real = scripted.scripted()

    def spy(fn):
        return lambda *a: calls.append(a[12]) or fn(*a)  # a[12]: the cache of keys, kept alive

    monkeypatch.setattr(scripted, "_WARM", set())
    monkeypatch.setattr(scripted, "_SCRIPTED", scripted.Scripted(spy(real.step), real.vision, real.prefix))
    loaded = load_model(small_folder)
    runner = Runner(loaded, n_pages=8, page_size=16, max_batch=4, executor=None, script=True)
    assert len(calls) == 6 and runner.k.data_ptr() not in [c.data_ptr() for c in calls]  # never the engine's own cache
    assert not runner.k.any() and not runner.v.any()
    Runner(loaded, n_pages=8, page_size=16, max_batch=4, executor=None, script=True)
    assert len(calls) == 6  # once per process and model shape


def test_the_warm_up_encodes_its_scratch_crops_with_one_encoder_layer(monkeypatch, small_folder):
    """The warm-up ran the whole vision encoder on 15 scratch crops: 22 s of a Moondream 2 load on
    two CPU cores. One layer profiles the loop's body; the first real encoding is no slower."""
    real, layers = scripted.scripted(), []

    def spy(fn, at):
        return lambda *a: layers.append(a[at]) or fn(*a)

    monkeypatch.setattr(scripted, "_WARM", set())
    monkeypatch.setattr(scripted, "_SCRIPTED", scripted.Scripted(real.step, spy(real.vision, 2), spy(real.prefix, 4)))
    loaded = load_model(small_folder)
    assert loaded.model.vision.cfg.enc_n_layers > 1
    Runner(loaded, n_pages=8, page_size=16, max_batch=4, executor=None, script=True)
    assert layers == [1] * 6


@pytest.mark.parametrize("model", ["tiny", "small", "gqa"])
def test_a_whole_step_in_one_call_matches_the_separate_eager_forwards(model, small_folder, gqa_folder):
    """Image prefixes, the prompts on them (whose first page copies the prefix's partial last
    page) and another sequence's decode rows: the same logits and KV, bit for bit (fp32)."""
    loaded = load_model({"tiny": "tiny", "small": small_folder, "gqa": gqa_folder}[model], dtype=torch.float32)
    runner = Runner(loaded, n_pages=64, page_size=16, max_batch=8, executor=None, script=True)
    text, cfg, ps = loaded.model.text, loaded.config, 16
    P, C, vocab = cfg.prefix_len, cfg.text.dim, cfg.text.vocab_size
    assert P % ps, "the test needs a partial last prefix page"
    rng = np.random.default_rng(11)
    free = list(rng.permutation(64))
    n_img, t, n_dec = 2, 5, 6
    img_pages = [[free.pop() for _ in range(-(-P // ps))] for _ in range(n_img)]
    # Each prompt's table: its image's full pages, then its own (the first holds the prefix's tail).
    tables = [p[:P // ps] + [free.pop() for _ in range(2)] for p in img_pages]
    dec_table = img_pages[0][:P // ps] + [free.pop() for _ in range(2)]
    at = lambda table, positions: np.array([table[p // ps] * ps + p % ps for p in positions])  # noqa: E731
    x = torch.randn(n_img, P, C)
    ids = torch.as_tensor(rng.integers(10, vocab, size=(n_img, t)))
    ppos = np.arange(P, P + t)[None].repeat(n_img, 0)
    dpos = np.arange(P + 1, P + 1 + n_dec)  # a sequence checking draft tokens, one row each
    dids = torch.as_tensor(rng.integers(10, vocab, size=n_dec))
    Lp, Lt, Ld = -(-P // ps) * ps, 2 * ps + P // ps * ps, len(dec_table) * ps
    img_mask = (torch.arange(Lp) < P).expand(P, Lp)[None, None]
    prompt_mask = torch.as_tensor(np.arange(Lt)[None, None] <= ppos[:, :, None])[:, None]
    dec_mask = (torch.arange(Ld)[None] <= torch.as_tensor(dpos)[:, None])[:, None, None]
    img_write = np.concatenate([at(p, range(P)) for p in img_pages])
    prompt_write = np.concatenate([at(tab, ppos[0]) for tab in tables])
    with torch.inference_mode():
        runner.k.copy_(torch.randn(runner.k.shape))
        runner.v.copy_(torch.randn(runner.v.shape))
        k0, v0 = runner.k.clone(), runner.v.clone()

        runner._hidden(x, torch.arange(P).expand(n_img, P), torch.as_tensor(img_write), torch.tensor(img_pages),
                       img_mask)
        for p, tab in zip(img_pages, tables):
            runner.copy_page(p[P // ps], tab[P // ps])
        h = runner._hidden(text.embed(ids), torch.as_tensor(ppos), torch.as_tensor(prompt_write), torch.tensor(tables),
                           prompt_mask)
        h_dec = runner._hidden(text.embed(dids)[:, None], torch.as_tensor(dpos)[:, None],
                               torch.as_tensor(at(dec_table, dpos)), torch.tensor([dec_table] * n_dec), dec_mask)
        eager = torch.cat([text.logits(h[:, -1]), text.logits(h_dec[:, -1])])
        k_eager, v_eager = runner.k.clone(), runner.v.clone()

        runner.k.copy_(k0)
        runner.v.copy_(v0)
        copies = np.array([(p[P // ps] * ps + j, tab[P // ps] * ps + j) for p, tab in zip(img_pages, tables)
                           for j in range(P % ps)])
        inputs = (torch.as_tensor(np.concatenate([np.tile(np.arange(P), n_img), ppos.reshape(-1), dpos])),
                  torch.as_tensor(np.concatenate([img_write, prompt_write, at(dec_table, dpos)])),
                  torch.as_tensor(copies[:, 0]), torch.as_tensor(copies[:, 1]), [[n_img, P], [n_img, t], [n_dec, 1]],
                  [torch.tensor(img_pages), torch.tensor(tables), torch.tensor([dec_table] * n_dec)],
                  [img_mask, prompt_mask, dec_mask],
                  torch.as_tensor([n_img * P + t - 1, n_img * P + 2 * t - 1,
                                   *range(n_img * (P + t), n_img * (P + t) + n_dec)]))
        _, got = runner._fused(list(x), torch.cat([ids.reshape(-1), dids]), inputs)
    assert torch.equal(got, eager)
    read = np.concatenate([at(p, range(P)) for p in img_pages] + [at(tab, range(P + t)) for tab in tables]
                          + [at(dec_table, range(P + 1 + n_dec))])
    assert torch.equal(runner.k[:, read], k_eager[:, read]) and torch.equal(runner.v[:, read], v_eager[:, read])


def test_a_call_holds_every_tensor_it_is_given_in_cpp_until_it_returns():
    # A TorchScript call that drops the last C++ reference to a tensor Python also holds takes the
    # GIL back to do so; on the device thread that waits behind the engine thread's host work,
    # once per tensor and step (pipelined decode steps ran ~10 % slower than blocking ones while
    # the pages and masks, passed in lists, were not held). Held, the call never needs the GIL.
    x, page, mask = torch.zeros(3), torch.zeros(2, dtype=torch.int64), torch.ones(1, dtype=torch.bool)
    seen = []
    call = scripted._holding(lambda a, n, pages, masks: seen.append(
        (a._use_count(), pages[0]._use_count(), masks[0]._use_count())))
    call(x, 3, [page], [mask])
    assert seen == [(2, 2, 2)]  # one reference from C++ besides Python's
    assert (x._use_count(), page._use_count(), mask._use_count()) == (1, 1, 1)  # released after


@pytest.mark.parametrize("model,dtype", [("tiny", torch.float32), ("small", torch.float32), ("gqa", torch.bfloat16)])
def test_an_image_prefix_in_one_call_is_bit_identical_to_the_eager_one(model, dtype, small_folder, gqa_folder):
    """The vision thread's work (normalise, encode, stitch and pool the tiles, project, BOS in
    front) in one TorchScript call: the same embeddings, bit for bit, for several tilings."""
    loaded = load_model({"tiny": "tiny", "small": small_folder, "gqa": gqa_folder}[model], dtype=dtype)
    runner = Runner(loaded, n_pages=8, page_size=16, max_batch=2, executor=None, script=True)
    model_, vc = loaded.model, loaded.config.vision
    rng = np.random.default_rng(5)
    for tiling in ((1, 1), (1, 2), (2, 3)):
        crops = rng.integers(0, 256, size=(1 + tiling[0] * tiling[1], vc.crop_size, vc.crop_size, 3), dtype=np.uint8)
        with torch.inference_mode():
            got = runner.vision_prefix(crops, tiling)
            feats = model_.vision.encode(normalize_crops(torch.from_numpy(crops), dtype))
            eager = model_.prefix_embeddings(model_.vision.project(feats, tiling))[0]
        assert got.dtype == eager.dtype and got.shape == (loaded.config.prefix_len, loaded.config.text.dim)
        assert torch.equal(got, eager), tiling
