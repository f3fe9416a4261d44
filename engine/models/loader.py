"""Load a model folder (Hugging Face Moondream layout) strictly and without doubling memory.

A folder holds `model.safetensors`, `tokenizer.json` and an optional `config.json`. Before any
weight is read, the checkpoint's header is checked against the config: every expected key
present with its expected shape, nothing unknown. Tensors are then read one at a time from the
memory-mapped file, converted to the target dtype and moved to the device, into a model built on
the meta device, so peak host memory is the converted model plus one tensor.

`tiny` names the embedded default preset (`engine/models/tiny/`). Until its trained weights ship,
that folder has no `model.safetensors` and its weights are generated deterministically (seed 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..device import resolve_device, resolve_dtype
from ..errors import ConfigError, ModelLoadError
from .moondream import MoondreamModel
from .tokenizer import Tokenizer
from .weights import PREFIX, expected_shapes, random_state_dict

TINY_DIR = Path(__file__).parent / "tiny"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


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
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model folder not found: {path}")
    if not path.is_dir():
        raise ModelLoadError(f"--model must be 'tiny' or a folder, and {path} is a file")
    return path


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    return ModelConfig.from_file(path) if path.exists() else ModelConfig()


def check_header(path: Path, config: ModelConfig) -> None:
    """Raise ModelLoadError naming the first key that is missing, unknown or of the wrong shape."""
    expected = expected_shapes(config)
    with _open(path) as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    missing = [k for k in expected if k not in found]
    if missing:
        raise ModelLoadError(f"{path}: missing weight {missing[0]} ({len(missing)} missing in all)")
    unknown = sorted(k for k in found if k not in expected)
    if unknown:
        raise ModelLoadError(f"{path}: unexpected weight {unknown[0]} ({len(unknown)} unexpected in all)")
    for key, shape in expected.items():
        if found[key] != shape:
            raise ModelLoadError(
                f"{path}: weight {key} has shape {list(found[key])}, the config expects {list(shape)}"
            )
        if dtypes[key] not in _DTYPES:
            raise ModelLoadError(f"{path}: weight {key} has unsupported dtype {dtypes[key]}")


def load_model(spec: str | Path = "tiny", device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None) -> LoadedModel:
    folder = resolve_model_dir(spec)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        config = read_config(folder)
    except ConfigError as e:
        raise ModelLoadError(str(e)) from None
    tokenizer = Tokenizer(folder / "tokenizer.json")
    weights = folder / "model.safetensors"

    with torch.device("meta"):
        model = MoondreamModel(config)
    if weights.exists():
        check_header(weights, config)
        state = {}
        with _open(weights) as f:
            for key in f.keys():
                state[key[len(PREFIX):]] = _read(f, key, weights).to(dtype=dt).to(dev)
    elif folder == TINY_DIR:
        state = {k[len(PREFIX):]: v.to(dt).to(dev) for k, v in random_state_dict(config, seed=0).items()}
    else:
        raise ModelLoadError(f"{weights} is missing: a model folder needs its model.safetensors")
    model.load_state_dict(state, assign=True, strict=True)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=folder, name=str(spec))


def _open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ModelLoadError(f"{path} is not a readable safetensors file: {_first_line(e)}") from None


def _read(f, key: str, path: Path) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read weight {key}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
