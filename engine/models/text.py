"""Phi-style text decoder: parallel attention + MLP blocks, partial rotary, untied lm_head.

The decoder does not own a KV cache. `TextModel.forward` computes q/k/v for the new tokens and
hands them, rotated, to an `attend(layer, q, k, v)` callback that stores k/v wherever its caller
keeps them (a contiguous buffer in the reference decoder, paged blocks in the engine) and returns
the attention output. Parameter names follow the checkpoint keys under `model.text.`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TextConfig
from .vision import MLP

# attend(layer, q_BHTD, k_BKTD, v_BKTD) -> out_BHTD
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ROPE_THETA = 10000.0


class _Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.qkv = nn.Linear(cfg.dim, cfg.qkv_dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)


class TextBlock(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim, eps=1e-5)
        self.attn = _Attention(cfg)
        self.mlp = MLP(cfg.dim, cfg.ff_dim, cfg.dim)


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.dim))
        self.blocks = nn.ModuleList(TextBlock(cfg) for _ in range(cfg.n_layers))
        self.post_ln = nn.LayerNorm(cfg.dim, eps=1e-5)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size)
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (max_context, rot_dim / 2), fp32, cached per device."""
        if device not in self._rope:
            rot = self.cfg.rot_dim
            freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, rot, 2, dtype=torch.float32)[: rot // 2] / rot))
            angles = torch.arange(self.cfg.max_context, dtype=torch.float32).unsqueeze(1) * freqs.unsqueeze(0)
            cis = torch.exp(1j * angles)
            self._rope[device] = (cis.real.contiguous().to(device), cis.imag.contiguous().to(device))
        return self._rope[device]

    def rotate(self, x_BHTD: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
        """Rotary on the first rot_dim dims of each head, pairs (i, i + rot_dim/2).

        The rotated pairs are written back interleaved, as the reference does; attention
        scores are the same in any layout applied alike to q and k.
        """
        cos, sin = self.rope_tables(x_BHTD.device)
        cos, sin = cos[pos_BT].unsqueeze(1), sin[pos_BT].unsqueeze(1)  # (B, 1, T, rot/2)
        rot = self.cfg.rot_dim
        x_rot, x_pass = x_BHTD[..., :rot], x_BHTD[..., rot:]
        xr, xi = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        out = torch.stack((xr * cos - xi * sin, xr * sin + xi * cos), dim=-1).flatten(-2)
        return torch.cat([out.to(x_BHTD.dtype), x_pass], dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    def forward(self, x_BTC: torch.Tensor, pos_BT: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Hidden states after all blocks (before post_ln) for inputs at positions pos_BT."""
        cfg = self.cfg
        b, t, _ = x_BTC.shape
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for i, block in enumerate(self.blocks):
            h = block.ln(x_BTC)
            q, k, v = block.attn.qkv(h).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = self.rotate(q.view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2), pos_BT)
            k = self.rotate(k.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2), pos_BT)
            v = v.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            a = attend(i, q, k, v).transpose(1, 2).reshape(b, t, cfg.dim)
            x_BTC = x_BTC + block.attn.proj(a) + block.mlp(h)
        return x_BTC

    def logits(self, h_BC: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.post_ln(h_BC))


def attention_mask(q_pos_T: torch.Tensor, kv_len: int, prefix_len: int) -> torch.Tensor:
    """Boolean (T, kv_len) mask: causal, except that the image prefix sees itself bidirectionally."""
    kv_pos = torch.arange(kv_len, device=q_pos_T.device)
    q = q_pos_T.unsqueeze(1)
    return (kv_pos <= q) | ((q < prefix_len) & (kv_pos < prefix_len))
