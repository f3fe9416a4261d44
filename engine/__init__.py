"""vlmstream's inference engine: a Moondream-family VLM served with pipelined decoding.

    from engine import Engine, EngineConfig, SamplingParams
    with Engine(EngineConfig(model="tiny")) as engine:
        handle = engine.submit(rgb_uint8_HxWx3, caption="short")
        print(handle.result().text)
"""

from .config import EngineConfig, ModelConfig
from .constraints import Choice, ConstraintError, JsonSchema, Regex
from .engine import Engine
from .region_decoder import RegionDecoder
from .errors import (ConfigError, DeviceError, EngineClosedError, ImageError, ModelLoadError, RequestError,
                     VlmstreamError)
from .request import ImageRef, RequestHandle
from .types import EngineStats, RequestOutput, SamplingParams

__all__ = [
    "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput", "EngineStats",
    "RequestHandle", "ImageRef", "VlmstreamError", "ConfigError", "DeviceError", "EngineClosedError",
    "ImageError", "ModelLoadError", "RequestError", "Regex", "Choice", "JsonSchema", "ConstraintError",
    "RegionDecoder",
]
