"""`ModelConfig` from and to a model folder's `config.json`: `{"text": {...}, "vision": {...},
"region": {...}, "tokenizer": {...}}`, possibly wrapped as `{"config": {...}}` (Hugging Face's).
Absent fields take the defaults; unknown fields, wrong types and values past any Moondream-family
model's are a `ConfigError` that names them. `from_dict(to_dict(c)) == c`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping

from .config import (CAPTION_LENGTHS, ModelConfig, PromptTemplate, RegionConfig, Templates, TextConfig,
                     TokenizerConfig, VisionConfig)
from .errors import ConfigError


def from_dict(data: Mapping[str, Any]) -> ModelConfig:
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
    elif "model_type" in data and not SECTIONS & set(data):
        # Another model's folder (a Llama's), or a Moondream 2 revision older than the one read: it
        # had been "unknown field config.architectures", as if a field of ours were mistyped.
        raise ConfigError(f"a Hugging Face config of model_type {data['model_type']!r} without Moondream 2's "
                          '"config" object: not a folder of the 2025-06-21 Moondream 2 revision')
    _reject_unknown(data, SECTIONS, "config")
    tok = dict(_section(data, "tokenizer"))
    templates = tok.pop("templates", None)
    rewrites = _rewrites(tok.pop("question_rewrites", []), "question_rewrites")
    captions = _rewrites(tok.pop("caption_rewrites", []), "caption_rewrites", CAPTION_LENGTHS)
    return ModelConfig(
        text=_build(TextConfig, _section(data, "text"), "text"),
        vision=_build(VisionConfig, _section(data, "vision"), "vision"),
        region=_build(RegionConfig, _section(data, "region"), "region"),
        tokenizer=dataclasses.replace(
            _build(TokenizerConfig, tok, "tokenizer"), templates=_templates(templates),
            question_rewrites=rewrites, caption_rewrites=captions,
        ),
    )


def from_file(path: Path) -> ModelConfig:
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
        return from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(config: ModelConfig) -> dict[str, Any]:
    t = config.tokenizer.templates
    tok = {f.name: getattr(config.tokenizer, f.name) for f in dataclasses.fields(config.tokenizer)}
    for name in ("question_rewrites", "caption_rewrites"):
        tok[name] = [list(r) for r in getattr(config.tokenizer, name)]
    tok["templates"] = {
        "caption": {k: list(v) for k, v in t.caption.items()},
        **{
            name: {"prefix": list(p.prefix), "suffix": list(p.suffix)}
            for name, p in (("query", t.query), ("detect", t.detect), ("point", t.point))
        },
    }
    return {
        "text": dataclasses.asdict(config.text),
        "vision": dataclasses.asdict(config.vision),
        "region": dataclasses.asdict(config.region),
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
