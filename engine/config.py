"""Model configuration: plain frozen data, validated once when it is built.

The field names and defaults are those of Moondream 2 (`shared/MOONDREAM2.md`). A model folder's
optional `config.json` holds `{"text": {...}, "vision": {...}, "region": {...}, "tokenizer": {...}}`,
possibly wrapped as `{"config": {...}}`; absent fields take the defaults, unknown fields are an
error that names them. `ModelConfig.from_dict(d).to_dict()` round-trips.
"""

from __future__ import annotations

import dataclasses
import json
import re
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
        if not isinstance(data, Mapping):
            raise ConfigError("config must be a JSON object")
        if "config" in data:
            # Hugging Face's wrapper: the real 2025-06-21 folder's config.json is {"architectures":
            # ["HfMoondream"], "auto_map": ..., "config": {}, "model_type": "moondream1",
            # "torch_dtype": "bfloat16", ...}. Its other keys are that library's, not the model's:
            # they are left alone (they had made the real folder an error), but a section of ours
            # beside "config" is a mistake worth saying.
            beside = sorted(SECTIONS & set(data))
            if beside:
                raise ConfigError(f'"{beside[0]}" must go inside "config" (config.json has a "config" object)')
            data = data["config"]
            if not isinstance(data, Mapping):
                raise ConfigError('"config" must be a JSON object')
        _reject_unknown(data, SECTIONS, "config")
        tok = dict(_section(data, "tokenizer"))
        templates = tok.pop("templates", None)
        rewrites = _rewrites(tok.pop("question_rewrites", []), "question_rewrites")
        captions = _rewrites(tok.pop("caption_rewrites", []), "caption_rewrites", CAPTION_LENGTHS)
        return cls(
            text=_build(TextConfig, _section(data, "text"), "text"),
            vision=_build(VisionConfig, _section(data, "vision"), "vision"),
            region=_build(RegionConfig, _section(data, "region"), "region"),
            tokenizer=dataclasses.replace(
                _build(TokenizerConfig, tok, "tokenizer"), templates=_templates(templates),
                question_rewrites=rewrites, caption_rewrites=captions,
            ),
        )

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        # A number of more than 4300 digits (Python's limit on int parsing), or arrays nested
        # thousands deep: tracebacks, exit 1.
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path} is not valid JSON: nested too deep") from None
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        t = self.tokenizer.templates
        tok = {f.name: getattr(self.tokenizer, f.name) for f in dataclasses.fields(self.tokenizer)}
        for name in ("question_rewrites", "caption_rewrites"):
            tok[name] = [list(r) for r in getattr(self.tokenizer, name)]
        tok["templates"] = {
            "caption": {k: list(v) for k, v in t.caption.items()},
            **{
                name: {"prefix": list(p.prefix), "suffix": list(p.suffix)}
                for name, p in (("query", t.query), ("detect", t.detect), ("point", t.point))
            },
        }
        return {
            "text": dataclasses.asdict(self.text),
            "vision": dataclasses.asdict(self.vision),
            "region": dataclasses.asdict(self.region),
            "tokenizer": tok,
        }


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = data.get(name, {})
    if not isinstance(section, Mapping):
        raise ConfigError(f'"{name}" must be a JSON object')
    return section


def _reject_unknown(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown field {where}.{unknown[0]} (known: {', '.join(sorted(known))})")


SECTIONS = frozenset({"text", "vision", "region", "tokenizer"})
MAX_INT, MAX_LAYERS, MAX_CONTEXT = 1 << 20, 1024, 1 << 15  # what config.json may ask (see _build)


def _build(cls: type, data: Mapping[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls) if f.name not in ("templates", "question_rewrites",
                                                                        "caption_rewrites")}
    _reject_unknown(data, names, where)
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if types[key] in (str, "str"):
            if not isinstance(value, str):
                raise ConfigError(f"{where}.{key} must be a string, got {value!r}")
            continue
        if types[key] in (bool, "bool"):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{key} must be true or false, got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}.{key} must be an integer, got {value!r}")
        if value < 0 or (value == 0 and not key.endswith("_id")):
            raise ConfigError(f"{where}.{key} must be positive, got {value}")
        # Far above any Moondream-family model's, and low enough that a slip (an extra zero or
        # ten) is said here: 10**12 layers had built shape tables until memory ran out, and a
        # context of 10**9 was a 2 TB allocation traceback.
        most = MAX_LAYERS if key.endswith("n_layers") else MAX_CONTEXT if key == "max_context" else MAX_INT
        if value > most:
            raise ConfigError(f"{where}.{key} is {value}, more than {most} (a mistake in config.json?)")
    return cls(**data)


def _ids(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"{where} must be a list of token ids")
    return tuple(value)


def _rewrites(data: Any, name: str, targets: tuple[str, ...] | None = None) -> tuple[tuple[str, str], ...]:
    """[pattern, replacement] pairs; with `targets`, the replacement is one of them (not a template)."""
    where = f"tokenizer.{name}"
    if not isinstance(data, list):
        raise ConfigError(f"{where} must be a list of [pattern, replacement] pairs")
    out = []
    for i, pair in enumerate(data):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ConfigError(f"{where}[{i}] must be a [pattern, replacement] pair of strings")
        if targets is not None and pair[1] not in targets:
            raise ConfigError(f"{where}[{i}]: {pair[1]!r} is not one of {', '.join(targets)}")
        try:
            re.compile(pair[0]).sub(pair[1] if targets is None else "", "")  # parses group references too
        # IndexError: a replacement names a group the pattern lacks; OverflowError: a{99999999999};
        # RecursionError: groups nested a thousand deep
        except (re.error, IndexError, OverflowError) as e:
            raise ConfigError(f"{where}[{i}]: {e}") from None
        except RecursionError:
            raise ConfigError(f"{where}[{i}]: the pattern is nested too deep") from None
        out.append((pair[0], pair[1]))
    return tuple(out)


def _templates(data: Any) -> Templates:
    default = Templates()
    if data is None:
        return default
    if not isinstance(data, Mapping):
        raise ConfigError('"tokenizer.templates" must be a JSON object')
    where = "tokenizer.templates"
    _reject_unknown(data, {"caption", "query", "detect", "point"}, where)
    caption = dict(default.caption)
    if "caption" in data:
        if not isinstance(data["caption"], Mapping):
            raise ConfigError(f"{where}.caption must be a JSON object")
        _reject_unknown(data["caption"], set(CAPTION_LENGTHS), f"{where}.caption")
        caption.update({k: _ids(v, f"{where}.caption.{k}") for k, v in data["caption"].items()})
        empty = [k for k in CAPTION_LENGTHS if not caption[k]]
        if empty:  # a caption prompt of no tokens: nothing to prefill, and the decoder failed on it
            raise ConfigError(f"{where}.caption.{empty[0]} must not be empty")
    prompts = {}
    for name in ("query", "detect", "point"):
        base = getattr(default, name)
        sub = data.get(name, {})
        if not isinstance(sub, Mapping):
            raise ConfigError(f"{where}.{name} must be a JSON object")
        _reject_unknown(sub, {"prefix", "suffix"}, f"{where}.{name}")
        prompts[name] = PromptTemplate(
            _ids(sub["prefix"], f"{where}.{name}.prefix") if "prefix" in sub else base.prefix,
            _ids(sub["suffix"], f"{where}.{name}.suffix") if "suffix" in sub else base.suffix,
        )
    return Templates(caption=caption, **prompts)
