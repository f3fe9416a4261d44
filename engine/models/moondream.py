"""The Moondream-family VLM: vision encoder, text decoder and region head under one module.

`state_dict()` keys, prefixed with `model.`, are the Hugging Face checkpoint keys. The module
computes; it keeps no per-request state (KV caches live with the decoders that use it).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from .region import RegionModel
from .text import TextModel
from .tiling import crops_to_tensor, overlap_crops
from .vision import VisionModel


class MoondreamModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.vision = VisionModel(config.vision)
        self.text = TextModel(config.text)
        self.region = RegionModel(config.region)

    @property
    def device(self) -> torch.device:
        return self.text.wte.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.wte.dtype

    def preprocess(self, rgb_HW3: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
        """RGB uint8 image -> normalised crops (N, 3, C, C) on the model's device, and the tiling."""
        crops, tiling = overlap_crops(rgb_HW3, self.config.vision)
        return crops_to_tensor(crops, self.device, self.dtype), tiling

    @torch.inference_mode()
    def image_tokens(self, crops_BCHW: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """Image tokens (n_patches, dim) that follow BOS in the image prefix."""
        return self.vision(crops_BCHW, tiling)

    @torch.inference_mode()
    def prefix_embeddings(self, image_tokens_NC: torch.Tensor) -> torch.Tensor:
        """BOS + image tokens: the (1, prefix_len, dim) input of the image-prefix prefill."""
        bos = torch.tensor([[self.config.tokenizer.bos_id]], device=self.device)
        return torch.cat([self.text.embed(bos), image_tokens_NC[None]], dim=1)
