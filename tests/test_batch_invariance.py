"""A row's result does not depend on the rows beside it (fp32 on CPU): the ground of the engine's
token-for-token match with the reference decoder, whatever its batches hold."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.models.loader import load_model
from engine.models.text import gemm_min_rows
from engine.runner import Runner
from test_scripted import fused_decode


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_a_decode_rows_logits_do_not_depend_on_its_batch(model, small_folder):
    loaded = load_model("tiny" if model == "tiny" else small_folder, dtype=torch.float32)
    runner = Runner(loaded, n_pages=40, page_size=16, max_batch=32, executor=None, script=True)
    text = loaded.model.text
    rng = np.random.default_rng(5)
    b = 24
    positions = rng.integers(3, 120, size=b)
    tables = np.stack([rng.choice(40, size=8, replace=False) for _ in range(b)])
    write = np.array([t[p // 16] * 16 + p % 16 for t, p in zip(tables, positions)])
    ids = torch.as_tensor(rng.integers(0, loaded.config.text.vocab_size, size=b))
    pos = torch.as_tensor(positions)[:, None]
    mask = (torch.arange(128)[None, :] <= pos)[:, None, None, :]
    runner.last_token[:b] = ids
    with torch.inference_mode():
        runner.k.copy_(torch.randn(runner.k.shape))
        runner.v.copy_(torch.randn(runner.v.shape))

        def rows(idx, scripted):
            i = torch.as_tensor(idx)
            args = (pos[i], torch.as_tensor(write[idx]), torch.as_tensor(tables[idx]), mask[i])
            if scripted:
                return fused_decode(runner, i, *args)
            h = text(text.embed(ids[i])[:, None], args[0], runner._attend(*args[1:]))
            return text.logits(h[:, -1])

        for scripted in (True, False):
            batch = rows(list(range(b)), scripted)
            for n in (1, 2, 5, 9, 15):  # the rows alone and in smaller batches
                assert torch.equal(rows(list(range(n)), scripted), batch[:n]), (scripted, n)


def test_the_measured_row_counts_make_the_models_gemms_row_invariant():
    loaded = load_model("tiny", dtype=torch.float32)
    text, cfg = loaded.model.text, loaded.config.text
    assert (text.min_rows, text.min_rows_ff) == gemm_min_rows(cfg, torch.float32, torch.device("cpu"))
    assert text.min_rows >= 4 and text.min_rows_ff >= 4
    g = torch.Generator().manual_seed(1)
    for lin, m in ((text.blocks[0].attn.qkv, text.min_rows), (text.blocks[1].mlp.fc1, text.min_rows),
                   (text.blocks[0].mlp.fc2, text.min_rows_ff), (text.lm_head, text.min_rows)):
        x = torch.randn(200, lin.in_features, generator=g)
        full = F.linear(x, lin.weight, lin.bias)
        for n in (1, 3, m - 1, m, m + 7, 100):
            padded = torch.cat([x[:n], x.new_zeros(max(m - n, 0), x.shape[1])])
            assert torch.equal(F.linear(padded, lin.weight, lin.bias)[:n], full[:n]), n
    assert gemm_min_rows(cfg, torch.bfloat16, torch.device("cpu")) == (4, 4)  # no exactness promised there


def test_bf16_rows_come_in_few_sizes_and_fp32_rows_are_not_bucketed():
    from engine.models.text import padded_rows

    sizes = [padded_rows(n, 4, True) for n in range(1, 2049)]
    assert all(s >= n for n, s in zip(range(1, 2049), sizes))
    assert all(s <= max(n + 7, n * 1.125) for n, s in zip(range(1, 2049), sizes))  # at most 1/8 more
    assert sizes == sorted(sizes) and len(set(sizes)) <= 50  # multiples of 8, then 8 sizes per doubling
    assert [padded_rows(n, 4, True) for n in sizes] == sizes  # a padded count stays as it is
    assert [padded_rows(n, 9, False) for n in (1, 9, 99)] == [9, 9, 99]
    assert load_model("tiny", dtype=torch.bfloat16).model.text.row_buckets
    assert not load_model("tiny", dtype=torch.float32).model.text.row_buckets  # exact: MKL, no kernel cache
