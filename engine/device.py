"""Device and dtype selection: the one place that decides what runs where.

CPU defaults to fp32, CUDA to bf16; both can be overridden. Asking for CUDA where none is
present is a `DeviceError`, not a crash deep inside torch.
"""

from __future__ import annotations

import torch

from .errors import ConfigError, DeviceError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"unknown device {name!r} (use cpu or cuda)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("CUDA was requested but no CUDA device is available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"{device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    elif device.type != "cpu":
        raise DeviceError(f"unsupported device {name!r} (use cpu or cuda)")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ConfigError(f"unsupported dtype {name}")
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r} (use float32, bfloat16 or float16)")
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work; host timings of CUDA stages need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
