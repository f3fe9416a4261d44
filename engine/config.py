"""Model configuration: plain frozen data, validated once when it is built.

The field names and defaults are those of Moondream 2 (`shared/MOONDREAM2.md`). A model folder's
optional `config.json` is read and written by config_json.py (`ModelConfig.from_file`,
`from_dict`, `to_dict`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

CAPTION_LENGTHS = ("short", "normal", "long")
RESAMPLE_FILTERS = ("lanczos", "bicubic")
TILINGS = ("moondream", "fill")


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rot_dim(self) -> int:
        """Rotary embedding covers the first half of each head (32 of 64 in Moondream 2)."""
        return self.head_dim // 2

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def _validate(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"text.dim ({self.dim}) must be a multiple of text.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"text.n_heads ({self.n_heads}) must be a multiple of text.n_kv_heads ({self.n_kv_heads})"
            )
        if self.rot_dim % 2:
            raise ConfigError(f"text head size {self.head_dim} must be a multiple of 4 (rotary pairs)")


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_inner_dim: int = 8192
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    # The crops' resampling filter (engine/models/tiling.py): "lanczos" as Moondream 2 was trained,
    # or "bicubic" (antialiased), 10x cheaper on CPU, for models trained or measured with it.
    resample: str = "lanczos"
    # How a frame is split into tiles (engine/models/tiling.py): "moondream", the published rule,
    # or "fill", which also tiles frames too small or too wide for it to (the tiny model's small
    # objects gain 7 points of shape answers at no cost on 640x360 frames; EVAL.md, eleventh session).
    tiling: str = "moondream"
    # A page of pure white or black around the objects (a drawing on paper, a slide) shown as mid
    # grey before the crops are cut (engine/models/tiling.py `page_to_grey`). For the tiny model:
    # its world never has such backgrounds (white and black are object colours there), and on them
    # it invented white circles and miscounted (EVAL.md, thirty-seventh session).
    page_to_grey: bool = False

    @property
    def grid(self) -> int:
        """Patches per side of one crop (27 in Moondream 2)."""
        return self.crop_size // self.enc_patch_size

    @property
    def n_patches(self) -> int:
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.enc_patch_size * self.enc_patch_size

    def _validate(self) -> None:
        if self.crop_size % self.enc_patch_size:
            raise ConfigError(
                f"vision.crop_size ({self.crop_size}) must be a multiple of vision.enc_patch_size "
                f"({self.enc_patch_size})"
            )
        if self.grid <= 2 * self.overlap_margin:
            raise ConfigError(
                f"vision.overlap_margin ({self.overlap_margin} patches on each side) leaves no usable "
                f"window in a crop of {self.grid} patches"
            )
        if self.enc_dim % self.enc_n_heads:
            raise ConfigError(
                f"vision.enc_dim ({self.enc_dim}) must be a multiple of vision.enc_n_heads ({self.enc_n_heads})"
            )
        if self.in_channels != 3:
            raise ConfigError(f"vision.in_channels must be 3 (RGB), got {self.in_channels}")
        if self.resample not in RESAMPLE_FILTERS:
            raise ConfigError(f"vision.resample must be one of {', '.join(RESAMPLE_FILTERS)}, got {self.resample!r}")
        if self.tiling not in TILINGS:
            raise ConfigError(f"vision.tiling must be one of {', '.join(TILINGS)}, got {self.tiling!r}")


@dataclass(frozen=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    trained: bool = True  # False: the weights are there but were never trained (the tiny model's)

    def _validate(self) -> None:
        for name in ("coord_feat_dim", "size_feat_dim"):
            if getattr(self, name) % 2:
                raise ConfigError(f"region.{name} must be even (cos and sin halves)")
        if self.size_out_dim % 2:
            raise ConfigError("region.size_out_dim must be even (width and height bins)")


@dataclass(frozen=True)
class PromptTemplate:
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]


@dataclass(frozen=True)
class Templates:
    caption: Mapping[str, tuple[int, ...]] = field(
        default_factory=lambda: {
            "short": (1, 32708, 2, 12492, 3),
            "normal": (1, 32708, 2, 6382, 3),
            "long": (1, 32708, 2, 4059, 3),
        }
    )
    query: PromptTemplate = PromptTemplate((1, 15381, 2), (3,))
    detect: PromptTemplate = PromptTemplate((1, 7235, 476, 2), (3,))
    point: PromptTemplate = PromptTemplate((1, 2581, 2), (3,))


@dataclass(frozen=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    templates: Templates = field(default_factory=Templates)
    # (pattern, replacement) pairs that bring a reworded question to the form the model was
    # trained on: the first pattern that fully matches the question (lower-cased, spaces
    # collapsed, end punctuation dropped) gives the question asked. A small model trained on a
    # fixed grammar (the embedded tiny one) needs them; real Moondream 2 has none.
    question_rewrites: tuple[tuple[str, str], ...] = ()
    # (pattern, caption length) pairs, matched the same way before the question rewrites: a
    # question that asks for a description ("What do you see?") gets that caption.
    caption_rewrites: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def __post_init__(self) -> None:
        self.text._validate()
        self.vision._validate()
        self.region._validate()
        if self.vision.proj_out_dim != self.text.dim:
            raise ConfigError(
                f"vision.proj_out_dim ({self.vision.proj_out_dim}) must equal text.dim ({self.text.dim})"
            )
        if self.region.dim != self.text.dim:
            raise ConfigError(f"region.dim ({self.region.dim}) must equal text.dim ({self.text.dim})")
        if self.text.max_context <= self.prefix_len:
            raise ConfigError(
                f"text.max_context ({self.text.max_context}) leaves no room after the image prefix "
                f"({self.prefix_len} tokens)"
            )
        tok = self.tokenizer
        ids = [getattr(tok, f.name) for f in dataclasses.fields(tok) if f.name.endswith("_id")]
        ids += [i for t in tok.templates.caption.values() for i in t]
        for tmpl in (tok.templates.query, tok.templates.detect, tok.templates.point):
            ids += list(tmpl.prefix) + list(tmpl.suffix)
        bad = [i for i in ids if not 0 <= i < self.text.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} in the tokenizer config is outside text.vocab_size ({self.text.vocab_size})")

    @property
    def prefix_len(self) -> int:
        """BOS + image tokens: the bidirectional image prefix (730 in Moondream 2)."""
        return 1 + self.vision.n_patches

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        from .config_json import from_dict

        return from_dict(data)

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        from .config_json import from_file

        return from_file(path)

    def to_dict(self) -> dict[str, Any]:
        from .config_json import to_dict

        return to_dict(self)
