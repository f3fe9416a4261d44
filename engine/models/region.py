"""Region head (detect / point): Fourier features of coordinates and sizes, encoders into text
space and decoders into 1024 bins. The weights are loaded and kept with the model; detect and
point decoding build on them in a later step. Parameter names follow `model.region.`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import RegionConfig
from .vision import MLP


class RegionModel(nn.Module):
    def __init__(self, cfg: RegionConfig):
        super().__init__()
        self.cfg = cfg
        self.coord_features = nn.Parameter(torch.zeros(1, cfg.coord_feat_dim // 2))
        self.coord_encoder = nn.Linear(cfg.coord_feat_dim, cfg.dim)
        self.coord_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.coord_out_dim)
        self.size_features = nn.Parameter(torch.zeros(2, cfg.size_feat_dim // 2))
        self.size_encoder = nn.Linear(cfg.size_feat_dim, cfg.dim)
        self.size_decoder = MLP(cfg.dim, cfg.inner_dim, cfg.size_out_dim)

    @staticmethod
    def _fourier(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        f = 2 * math.pi * x @ w
        return torch.cat([f.cos(), f.sin()], dim=-1)

    def encode_coordinate(self, coord_N1: torch.Tensor) -> torch.Tensor:
        return self.coord_encoder(self._fourier(coord_N1, self.coord_features))

    def encode_size(self, size_N2: torch.Tensor) -> torch.Tensor:
        return self.size_encoder(self._fourier(size_N2, self.size_features))

    def decode_coordinate(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        return self.coord_decoder(hidden_NC)

    def decode_size(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        """Logits (N, 2, bins) for width and height; size = 2 ** ((bin / (bins - 1)) * 10 - 10)."""
        return self.size_decoder(hidden_NC).view(hidden_NC.shape[0], 2, -1)
