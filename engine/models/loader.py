"""Load a model folder (Hugging Face Moondream layout) strictly and without doubling memory.

A folder holds `model.safetensors`, `tokenizer.json` and an optional `config.json`. Before any
weight is read, the checkpoint's header is checked against the config: every expected key
present with its expected shape and a float dtype, nothing unknown. Tensors are then read one at
a time from the memory-mapped file (see `checkpoint.py`), converted to the target dtype and moved
to the device, into a model built on the meta device, so peak host memory is the converted model
plus one tensor.

`tiny` names the embedded default model (`engine/models/tiny/`, written by `vlmstream train-tiny`).
`random:moondream2` (or `random:tiny`) builds that layout with deterministic random weights drawn
directly on the target device, for benchmarks of a full-size model where no checkpoint exists
(the tiny tokenizer stands in: random weights make every token equally meaningless).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..device import resolve_device, resolve_dtype
from ..errors import ConfigError, ModelLoadError, shortened
from .checkpoint import FLOAT_DTYPES, Checkpoint
from .moondream import MoondreamModel
from .text import gemm_min_rows
from .tokenizer import Tokenizer
from .weights import PREFIX, expected_shapes

TINY_DIR = Path(__file__).parent / "tiny"


@dataclass
class LoadedModel:
    model: MoondreamModel
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    name: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def resolve_model_dir(spec: str | Path) -> Path:
    if str(spec) == "tiny":
        return TINY_DIR
    if isinstance(spec, str) and not spec.strip():  # Path("") is the working folder
        raise ModelLoadError("the model is empty: give 'tiny' or a model folder")
    path = Path(spec).expanduser()
    try:
        found = path.exists()
    # A name past the file system's limit (its [Errno 36] repeated it whole), a folder on the way
    # that this user may not enter.
    except OSError as e:
        raise ModelLoadError(f"cannot reach the model folder {shortened(str(path))}: {e.strerror}") from None
    if not found:
        raise ModelLoadError(f"model folder not found: {path}")
    if not path.is_dir():
        # Not "--model": the web UI's Settings and the engine API say it too
        raise ModelLoadError(f"the model must be 'tiny' or a folder, and {path} is a file")
    return path


CONFIG_MAX_BYTES = 1_000_000  # Moondream 2's is under 2 KB


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.exists():
        return ModelConfig()
    # A named pipe there waited for ever, a link to /dev/zero read until the machine ran out of memory.
    if not path.is_file():
        raise ConfigError(f"{path} is not a file")
    size = path.stat().st_size
    if size > CONFIG_MAX_BYTES:
        raise ConfigError(f"{path} is {size} bytes: not a model's config (at most {CONFIG_MAX_BYTES})")
    return ModelConfig.from_file(path)


def check_header(ckpt: Checkpoint, config: ModelConfig) -> None:
    """Raise ModelLoadError naming the first key that is missing, unknown or of the wrong shape."""
    expected = expected_shapes(config)
    found = set(ckpt.keys())
    missing = [k for k in expected if k not in found]
    if missing:
        raise ModelLoadError(f"{ckpt.path}: missing weight {missing[0]} ({len(missing)} missing in all)")
    unknown = sorted(found - set(expected))
    if unknown:
        raise ModelLoadError(f"{ckpt.path}: unexpected weight {unknown[0]} ({len(unknown)} unexpected in all)")
    for key, shape in expected.items():
        if ckpt.shape(key) != shape:
            raise ModelLoadError(
                f"{ckpt.path}: weight {key} has shape {list(ckpt.shape(key))}, the config expects {list(shape)}"
            )
        if ckpt.dtype_name(key) not in FLOAT_DTYPES:
            raise ModelLoadError(f"{ckpt.path}: weight {key} has unsupported dtype {ckpt.dtype_name(key)}")


RANDOM_PREFIX = "random:"


def model_id(spec: str | Path) -> str:
    """A model named as two runs can compare it: "tiny", "random:LAYOUT", or its folder's real
    path (./m and m, or a link to it, are one model)."""
    spec = str(spec)
    if spec == "tiny" or spec.startswith(RANDOM_PREFIX):
        return spec
    real = os.path.realpath(os.path.expanduser(spec))
    return "tiny" if real == os.path.realpath(TINY_DIR) else real


def load_model(spec: str | Path = "tiny", device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None) -> LoadedModel:
    if isinstance(spec, str) and spec.startswith(RANDOM_PREFIX):
        return random_model(spec[len(RANDOM_PREFIX):], device, dtype)
    folder, dev, dt, config, tokenizer, weights = _open(spec, device, dtype)
    with Checkpoint(weights) as ckpt:
        check_header(ckpt, config)
        state, zeros = {}, []
        for key in ckpt.keys():
            state[key[len(PREFIX):]] = tensor = ckpt.read(key, dt, dev)
            # One NaN weight answered every prompt with an empty text, exit 0; so did fp32 weights
            # past 65504 read as float16 (inf).
            if not (tensor.is_floating_point() and tensor.numel()):
                continue
            least, greatest = _extremes(tensor)
            if not (math.isfinite(least) and math.isfinite(greatest)):
                raise ModelLoadError(f"{weights}: weight {key} holds NaN or infinite values"
                                     + (f" once read as {str(dt).removeprefix('torch.')}"
                                        if ckpt.dtype_name(key) != "F16" and dt == torch.float16 else ""))
            # A download cut short into a file of its full size (preallocated) ends in zeros: it
            # answered every prompt with an empty text, exit 0. Two zero matrices, not one: a
            # trained model might keep one (a part never trained), none keeps several.
            if tensor.dim() >= 2 and least == greatest == 0:
                zeros.append(key)
                if len(zeros) == 2:
                    raise ModelLoadError(f"{weights}: weights {zeros[0]}, {key} and maybe more are all zeros "
                                         "(a download cut short?)")
    return _assemble(config, state, tokenizer, folder, str(spec))


def _extremes(tensor: torch.Tensor) -> tuple[float, float]:
    """Its least and greatest values, which carry any NaN or inf (a tenth of the time of isfinite
    over every value: ~9 s on Moondream 2's 1.9 B)."""
    least, greatest = torch.aminmax(tensor)
    return float(least), float(greatest)


def check_model(spec: str | Path = "tiny", device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None) -> None:
    """Every check load_model makes, with its errors, without reading a weight (a settings page
    says a mistake before it stops what runs)."""
    if isinstance(spec, str) and spec.startswith(RANDOM_PREFIX):
        resolve_dtype(dtype, resolve_device(device))
        return
    _, _, _, config, _, weights = _open(spec, device, dtype)
    with Checkpoint(weights) as ckpt:
        check_header(ckpt, config)


def _open(spec: str | Path, device: str | torch.device, dtype: str | torch.dtype | None) -> tuple:
    folder = resolve_model_dir(spec)
    try:  # a folder this user may not read was a PermissionError traceback
        snapshot = _cache_snapshot(folder)
        (folder / "model.safetensors").exists()
    except OSError as e:
        raise ModelLoadError(f"cannot read the model folder {folder}: {e.strerror}") from None
    if snapshot and not (folder / "model.safetensors").exists():
        raise ModelLoadError(f"{folder} is a Hugging Face cache folder: point the model at one of its snapshots, "
                             f"e.g. {snapshot}")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        _refuse_broken_link(folder / name)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        config = read_config(folder)
    except ConfigError as e:
        raise ModelLoadError(str(e)) from None
    tokenizer = Tokenizer(folder / "tokenizer.json")
    if tokenizer.max_id >= config.text.vocab_size:  # said at the first prompt that used such an id
        raise ModelLoadError(f"{tokenizer.path} has token ids up to {tokenizer.max_id}, past the model's vocabulary "
                             f"of {config.text.vocab_size} (config.json's text.vocab_size): not this model's tokenizer")
    weights = folder / "model.safetensors"
    if weights.exists() and not weights.is_file():  # a named pipe: opened, it waited for ever
        raise ModelLoadError(f"{weights} is not a file")
    if not weights.exists():
        if (folder / "model.safetensors.index.json").exists():
            raise ModelLoadError(f"{weights} is missing: the weights are split into shards "
                                 "(model.safetensors.index.json), and one model.safetensors is read")
        raise ModelLoadError(f"{weights} is missing: a model folder needs its model.safetensors")
    return folder, dev, dt, config, tokenizer, weights


def _cache_snapshot(folder: Path) -> Path | None:
    """The snapshot with weights to name when `folder` is a Hugging Face cache's models--owner--name/
    or its snapshots/: the revision refs/main names (the one last downloaded), else the first (by
    hash, which had named an older revision's, of another layout, beside the current one)."""
    root = folder.parent if folder.name == "snapshots" else folder
    found = sorted(p.parent for p in (root / "snapshots").glob("*/model.safetensors"))
    ref = root / "refs" / "main"
    if found and ref.is_file():
        with open(ref, encoding="utf-8", errors="replace") as f:
            main = root / "snapshots" / f.read(100).strip()
        if main in found:
            return main
    return found[0] if found else None


def _refuse_broken_link(path: Path) -> None:
    """A Hugging Face snapshot copied with `cp -r` keeps links to ../../blobs/ that lead nowhere:
    its files, there in `ls`, had been said to be missing (and such a config.json silently absent)."""
    if path.is_symlink() and not path.exists():
        raise ModelLoadError(f"{path} is a link to {os.readlink(path)}, which is not there (a Hugging Face "
                             "snapshot copied without its blobs? copy it with cp -rL)")


def _assemble(config: ModelConfig, state: dict, tokenizer: Tokenizer, path: Path, name: str) -> LoadedModel:
    """The model built on the meta device and handed its weights: no second copy in memory."""
    with torch.device("meta"):
        model = MoondreamModel(config)
    model.load_state_dict(state, assign=True, strict=True)
    model.eval().requires_grad_(False)
    dtype, device = model.text.wte.dtype, model.text.wte.device
    model.text.min_rows, model.text.min_rows_ff = gemm_min_rows(config.text, dtype, device)
    # bf16/fp16 matmuls on CPU go through oneDNN, which keeps a kernel per shape (text.padded_rows)
    model.text.row_buckets = device.type == "cpu" and dtype != torch.float32
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, name=name)


def random_model(layout: str, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                 seed: int = 0) -> LoadedModel:
    """A model of a known layout with random weights generated on `device` (see the module doc)."""
    from .weights import random_state_dict

    if layout == "moondream2":
        config = ModelConfig()
    elif layout == "tiny":
        config = read_config(TINY_DIR)
    else:
        raise ModelLoadError(f"unknown random layout {layout!r} (use random:moondream2 or random:tiny)")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    state = {k[len(PREFIX):]: v for k, v in random_state_dict(config, seed=seed, dtype=dt, device=dev).items()}
    return _assemble(config, state, Tokenizer(TINY_DIR / "tokenizer.json"), TINY_DIR, RANDOM_PREFIX + layout)
