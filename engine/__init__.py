"""vlmstream's inference engine: a Moondream-family VLM served with pipelined decoding.

    from engine import Engine, EngineConfig, SamplingParams
    with Engine(EngineConfig(model="tiny")) as engine:
        handle = engine.submit(rgb_uint8_HxWx3, caption="short")
        print(handle.result().text)

The names below load on first use (PEP 562): `from engine.errors import ...` and the command
line's `--help` and argument errors then answer without importing torch (~4 s).
"""

import importlib

_HOMES = {
    "EngineConfig": "engine_config", "ModelConfig": "config",
    "Choice": "constraints", "JsonSchema": "constraints", "Regex": "constraints",
    "Engine": "engine",
    "RegionDecoder": "region_decoder",
    "ConfigError": "errors", "ConstraintError": "errors", "DeviceError": "errors", "EngineClosedError": "errors", "ImageError": "errors",
    "ModelLoadError": "errors", "RequestError": "errors", "VlmstreamError": "errors",
    "ImageRef": "request", "RequestHandle": "request",
    "EngineStats": "types", "RequestOutput": "types", "SamplingParams": "types",
}

__all__ = [
    "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput", "EngineStats",
    "RequestHandle", "ImageRef", "VlmstreamError", "ConfigError", "DeviceError", "EngineClosedError",
    "ImageError", "ModelLoadError", "RequestError", "Regex", "Choice", "JsonSchema", "ConstraintError",
    "RegionDecoder",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
