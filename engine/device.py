"""The small layer that makes CPU and CUDA look alike: device and dtype selection, and which
of the fast paths (Triton kernels, CUDA graphs, TorchScript) a device takes. The executor that
runs engine steps in launch order is `executor.py`.

CPU defaults to fp32, CUDA to bf16; both can be overridden. Asking for CUDA where none is
present is a `DeviceError`, not a crash deep inside torch.
"""

from __future__ import annotations

import os

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


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True on x86 CPUs with bf16 matrix instructions (AVX512-BF16 or AMX-BF16), where bf16 GEMMs
    run several times faster than fp32 ones; elsewhere bf16 on CPU is emulated and slower."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def use_triton_kernels(flag: bool | None, device: torch.device) -> bool:
    """Resolve EngineConfig.triton_kernels: default on for CUDA; on CPU only in Triton's interpreter."""
    if flag is None:
        return device.type == "cuda"
    if flag and device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
            raise ConfigError("triton_kernels=True on CPU needs TRITON_INTERPRET=1 (Triton's interpreter, for tests)")
    return bool(flag)


def graph_mode(flag: bool | None, device: torch.device) -> str | None:
    """Resolve EngineConfig.cuda_graphs: "capture" (CUDA graphs for decode) or None (eager)."""
    if flag and device.type != "cuda":
        raise ConfigError("cuda_graphs=True needs a CUDA device")
    if flag is None:
        flag = device.type == "cuda"
    return "capture" if flag else None


def script_mode(flag: bool | None, device: torch.device, kernels: bool) -> bool:
    """Resolve EngineConfig.cpu_script: the CPU forwards through TorchScript, CPU only."""
    if flag and device.type != "cpu":
        raise ConfigError("cpu_script=True needs the CPU device")
    if flag and kernels:
        raise ConfigError("cpu_script=True and triton_kernels=True exclude each other (both replace the decode step)")
    return device.type == "cpu" and not kernels if flag is None else bool(flag)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work; host timings of CUDA stages need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
