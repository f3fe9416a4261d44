"""The weight-key contract of the Hugging Face Moondream 2 layout, derived from a config.

`expected_shapes(config)` lists every key of `model.safetensors` with its shape; for the default
config it is exactly `shared/moondream2_weights.tsv` (592 keys). `random_state_dict` makes weights
of that layout deterministically from a seed: the embedded tiny preset uses it until trained
weights ship, and tests and benchmarks use it for shrunken or full-size checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig

PREFIX = "model."


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    v, t, r = config.vision, config.text, config.region
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, n_in: int, n_out: int) -> None:
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    def norm(name: str, n: int) -> None:
        shapes[f"{name}.weight"] = (n,)
        shapes[f"{name}.bias"] = (n,)

    shapes["model.vision.pos_emb"] = (1, v.n_patches, v.enc_dim)
    linear("model.vision.patch_emb", v.patch_dim, v.enc_dim)
    for i in range(v.enc_n_layers):
        b = f"model.vision.blocks.{i}"
        norm(f"{b}.ln1", v.enc_dim)
        linear(f"{b}.attn.qkv", v.enc_dim, 3 * v.enc_dim)
        linear(f"{b}.attn.proj", v.enc_dim, v.enc_dim)
        norm(f"{b}.ln2", v.enc_dim)
        linear(f"{b}.mlp.fc1", v.enc_dim, v.enc_ff_dim)
        linear(f"{b}.mlp.fc2", v.enc_ff_dim, v.enc_dim)
    norm("model.vision.post_ln", v.enc_dim)
    linear("model.vision.proj_mlp.fc1", 2 * v.enc_dim, v.proj_inner_dim)
    linear("model.vision.proj_mlp.fc2", v.proj_inner_dim, v.proj_out_dim)

    shapes["model.text.wte"] = (t.vocab_size, t.dim)
    for i in range(t.n_layers):
        b = f"model.text.blocks.{i}"
        norm(f"{b}.ln", t.dim)
        linear(f"{b}.attn.qkv", t.dim, t.qkv_dim)
        linear(f"{b}.attn.proj", t.dim, t.dim)
        linear(f"{b}.mlp.fc1", t.dim, t.ff_dim)
        linear(f"{b}.mlp.fc2", t.ff_dim, t.dim)
    norm("model.text.post_ln", t.dim)
    linear("model.text.lm_head", t.dim, t.vocab_size)

    shapes["model.region.coord_features"] = (1, r.coord_feat_dim // 2)
    shapes["model.region.size_features"] = (2, r.size_feat_dim // 2)
    linear("model.region.coord_encoder", r.coord_feat_dim, r.dim)
    linear("model.region.coord_decoder.fc1", r.dim, r.inner_dim)
    linear("model.region.coord_decoder.fc2", r.inner_dim, r.coord_out_dim)
    linear("model.region.size_encoder", r.size_feat_dim, r.dim)
    linear("model.region.size_decoder.fc1", r.dim, r.inner_dim)
    linear("model.region.size_decoder.fc2", r.inner_dim, r.size_out_dim)
    return shapes


def random_state_dict(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Deterministic random weights: LayerNorms near identity, linears scaled by 1/sqrt(fan_in)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for key, shape in expected_shapes(config).items():
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if ".ln" in key or "post_ln" in key:
            x = (1.0 + 0.1 * x) if key.endswith(".weight") else 0.02 * x
        elif key.endswith(".weight") and len(shape) == 2:
            x = x * shape[1] ** -0.5
        elif key.endswith(".bias"):
            x = 0.02 * x
        elif key.endswith("wte"):
            x = 0.5 * x
        else:  # pos_emb, Fourier features
            x = 0.1 * x
        state[key] = x.to(dtype)
    return state


def save_weights(path: Path, state: dict[str, torch.Tensor]) -> None:
    """model.safetensors, created like any other file: safetensors' save_file makes it 0600
    whatever the umask, so a folder shared with others would hold weights only its owner reads."""
    from safetensors.torch import save

    Path(path).write_bytes(save({k: v.contiguous() for k, v in state.items()}))


def save_model_folder(
    folder: Path,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer_json: Path,
) -> None:
    """Write a model folder in the Hugging Face layout: model.safetensors, tokenizer.json, config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(folder / "model.safetensors", state)
    (folder / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=1), encoding="utf-8")
