import math
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.models.weights import expected_shapes

TSV = Path(__file__).parent / "data" / "moondream2_weights.tsv"


def test_default_layout_is_exactly_the_published_checkpoint():
    published = {}
    for line in TSV.read_text().splitlines():
        key, shape, _dtype = line.split("\t")
        published[key] = tuple(int(x) for x in shape.strip("()").split(",") if x.strip())
    ours = expected_shapes(ModelConfig())
    assert len(published) == 592
    assert ours == published


def test_model_parameters_cover_the_layout():
    import torch

    from engine.models.moondream import MoondreamModel

    config = ModelConfig()
    with torch.device("meta"):
        model = MoondreamModel(config)
    names = {"model." + k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert names == expected_shapes(config)


# The computation the contract (shared/MOONDREAM2.md) states, written out plainly from the weights:
# the trained tiny model's answers did not move when, in the vision encoder, q and k were swapped,
# patches flattened row/column-transposed, [global, local] concatenated the other way round, the
# stitched map max-pooled, or inner margins kept; real Moondream 2 weights would answer wrongly.

def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _layer_norm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


def _contract_image_tokens(sd, cfg, crops, tiling):
    """Image tokens (n_patches, text dim) of normalised crops (N, 3, C, C), as the contract says."""
    n, ch, c, _ = crops.shape
    p, g, d, heads, m = cfg.enc_patch_size, cfg.grid, cfg.enc_dim, cfg.enc_n_heads, cfg.overlap_margin
    # (N, 3, g, p, g, p) -> per patch (row-major over the grid), values in channel, row, column order
    patches = crops.reshape(n, ch, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, ch * p * p)

    def lin(x, name):
        return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]

    x = lin(patches, "vision.patch_emb") + sd["vision.pos_emb"]
    for i in range(cfg.enc_n_layers):
        blk = f"vision.blocks.{i}"
        h = _layer_norm(x, sd[f"{blk}.ln1.weight"], sd[f"{blk}.ln1.bias"])
        q, k, v = lin(h, f"{blk}.attn.qkv").split(d, dim=-1)
        q, k, v = (t.reshape(n, g * g, heads, d // heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1) @ v
        x = x + lin(att.transpose(1, 2).reshape(n, g * g, d), f"{blk}.attn.proj")
        h = _layer_norm(x, sd[f"{blk}.ln2.weight"], sd[f"{blk}.ln2.bias"])
        x = x + lin(_gelu_tanh(lin(h, f"{blk}.mlp.fc1")), f"{blk}.mlp.fc2")
    x = _layer_norm(x, sd["vision.post_ln.weight"], sd["vision.post_ln.bias"])

    rows, cols = tiling
    tiles = x[1:].reshape(rows * cols, g, g, d)

    def kept(i, j):  # a tile's centre, with its margin only where it is on the image's edge
        ys = slice(0 if i == 0 else m, g if i == rows - 1 else g - m)
        xs = slice(0 if j == 0 else m, g if j == cols - 1 else g - m)
        return tiles[i * cols + j][ys, xs]

    local = torch.cat([torch.cat([kept(i, j) for j in range(cols)], dim=1) for i in range(rows)], dim=0)
    pooled = torch.nn.functional.adaptive_avg_pool2d(local.permute(2, 0, 1), (g, g)).permute(1, 2, 0)
    joined = torch.cat([x[0], pooled.reshape(g * g, d)], dim=-1)
    return lin(_gelu_tanh(lin(joined, "vision.proj_mlp.fc1")), "vision.proj_mlp.fc2")


def _small_model():
    from engine.models.moondream import MoondreamModel
    from engine.models.weights import random_state_dict

    from conftest import small_config

    config = small_config(gqa=True)  # 2 vision heads, 6x6 patch grid, 1-patch margins
    model = MoondreamModel(config)
    model.load_state_dict({k[len("model."):]: v.double() for k, v in random_state_dict(config, seed=3).items()})
    return model.double().eval(), config


def test_image_tokens_are_the_contracts():
    import numpy as np

    model, config = _small_model()
    rgb = np.random.default_rng(0).integers(0, 256, size=(100, 120, 3), dtype=np.uint8)
    from engine.models.tiling import overlap_crops

    crops, tiling = model.preprocess(rgb)
    assert tiling == (2, 2)  # inner margins to drop in both directions
    # normalised as (x / 255 - 0.5) / 0.5, channels first, rows before columns
    u8, _ = overlap_crops(rgb, config.vision)
    assert torch.allclose(crops, torch.from_numpy(u8).permute(0, 3, 1, 2).double() / 127.5 - 1)
    got = model.image_tokens(crops, tiling)
    want = _contract_image_tokens(model.state_dict(), config.vision, crops, tiling)
    assert got.shape == (config.vision.n_patches, config.text.dim)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()  # GELU runs in fp32


def test_every_layer_norm_has_the_contracts_epsilon():
    # 1e-6 in a text or vision LayerNorm left every test of the (trained) tiny model passing.
    from torch import nn

    model, _ = _small_model()
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 1 + 2 + 1  # vision ln1/ln2 x 2 blocks, post_ln; text ln x 2, post_ln
    assert {m.eps for m in norms} == {1e-5}


def test_gelu_is_the_tanh_approximation_with_and_without_autograd():
    # With autograd (training, and CUDA at inference) the fused torch kernel runs instead of the
    # CPU formula; an exact (erf) GELU there was not noticed by any test.
    from engine.models.vision import gelu_tanh

    x = torch.linspace(-6, 6, 1001)
    want = _gelu_tanh(x.double()).float()
    assert torch.allclose(gelu_tanh(x), want, rtol=1e-5, atol=1e-6)
    with torch.enable_grad():
        assert torch.allclose(gelu_tanh(x.clone().requires_grad_()).detach(), want, rtol=1e-5, atol=1e-6)


def test_region_fourier_features_and_size_bins_are_the_contracts():
    # The region decoder's protocol test re-reads the sequence through these same functions, so
    # their formulas are checked here: [cos, sin] of 2*pi*x@W, and size logits [width bins, height bins].
    model, config = _small_model()
    region, sd = model.region, model.state_dict()
    coord = torch.tensor([[0.25], [0.8]], dtype=torch.float64)
    f = 2 * math.pi * coord @ sd["region.coord_features"]
    feats = torch.cat([torch.cos(f), torch.sin(f)], dim=-1)
    want = feats @ sd["region.coord_encoder.weight"].T + sd["region.coord_encoder.bias"]
    assert torch.allclose(region.encode_coordinate(coord), want)

    size = torch.tensor([[0.1, 0.3]], dtype=torch.float64)
    f = 2 * math.pi * size @ sd["region.size_features"]
    feats = torch.cat([torch.cos(f), torch.sin(f)], dim=-1)
    want = feats @ sd["region.size_encoder.weight"].T + sd["region.size_encoder.bias"]
    assert torch.allclose(region.encode_size(size), want)

    hidden = torch.randn(3, config.region.dim, dtype=torch.float64)
    flat = region.size_decoder(hidden)
    bins = config.region.size_out_dim // 2
    got = region.decode_size(hidden)
    assert got.shape == (3, 2, bins)
    assert torch.equal(got[:, 0], flat[:, :bins]) and torch.equal(got[:, 1], flat[:, bins:])


def test_the_image_prefix_attends_both_ways_and_everything_after_it_causally():
    # BOS and the image tokens (positions 0..prefix_len-1) see one another whole; the prompt and
    # answer after them see what came before. The prefix one short either way changed no answer
    # of the tiny model nor any decoder test.
    from engine.models.text import attention_mask

    prefix = ModelConfig().prefix_len  # 730
    n = prefix + 3
    mask = attention_mask(torch.arange(n), n, prefix)
    want = torch.ones(n, n, dtype=torch.bool).tril()
    want[:prefix, :prefix] = True
    assert torch.equal(mask, want)
    assert mask[0, prefix - 1] and mask[prefix - 1, 0] and not mask[prefix - 1, prefix]
    assert mask[prefix, : prefix + 1].all() and not mask[prefix, prefix + 1:].any()
