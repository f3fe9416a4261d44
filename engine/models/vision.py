"""SigLIP-style vision encoder, crop stitching and projection into text-embedding space.

All crops of an image go through the encoder as one batch. The global crop's features and the
stitched, pooled tile features are concatenated per patch and projected by `proj_mlp` into
`n_patches` image tokens of the text width. Parameter names follow the checkpoint keys under
`model.vision.`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VisionConfig
from .tiling import reconstruct


_GELU_K = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation, as x * sigmoid(2u) (= 0.5 x (1 + tanh u)), computed in fp32.

    The same function as F.gelu(approximate="tanh") (within fp32 rounding), but torch's CPU tanh
    kernel makes F.gelu 2.3x slower than this on CPU, where it was an eighth of a video step.
    CUDA and autograd keep the fused kernel.
    """
    if x.is_cuda or (x.requires_grad and torch.is_grad_enabled()):
        return F.gelu(x, approximate="tanh")
    xf = x.float()
    u = xf * xf
    u.mul_(0.044715 * _GELU_K).add_(_GELU_K).mul_(xf)
    return u.sigmoid_().mul_(xf).to(x.dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, computed in fp32 for bf16/fp16 inputs on CPU.

    torch's CPU attention kernel in bf16 is slower than casting to fp32 and back (4x for a
    32-row decode step, 1.1x for prefills here) and less exact. CUDA keeps the native kernels.
    """
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        # Training on CPU: torch's fused CPU attention backward is ~3x slower than these few
        # matmuls at our sizes (81-300 tokens), a third of a train-tiny step.
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5)
        if attn_mask is not None:
            scores.masked_fill_(~attn_mask, float("-inf"))
        return scores.softmax(-1).to(v.dtype) @ v
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                             enable_gqa=enable_gqa)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


class MLP(nn.Module):
    def __init__(self, n_in: int, n_hidden: int, n_out: int):
        super().__init__()
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.fc2 = nn.Linear(n_hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class _Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.n_heads = cfg.enc_n_heads
        self.ln1 = nn.LayerNorm(cfg.enc_dim, eps=1e-5)
        self.attn = _Attention(cfg.enc_dim)
        self.ln2 = nn.LayerNorm(cfg.enc_dim, eps=1e-5)
        self.mlp = MLP(cfg.enc_dim, cfg.enc_ff_dim, cfg.enc_dim)

    def forward(self, x_BNC: torch.Tensor) -> torch.Tensor:
        b, n, c = x_BNC.shape
        qkv = self.attn.qkv(self.ln1(x_BNC))
        q, k, v = (t.view(b, n, self.n_heads, c // self.n_heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        a = sdpa(q, k, v).transpose(1, 2).reshape(b, n, c)
        x_BNC = x_BNC + self.attn.proj(a)
        return x_BNC + self.mlp(self.ln2(x_BNC))


class VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_emb = nn.Linear(cfg.patch_dim, cfg.enc_dim)
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.n_patches, cfg.enc_dim))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.enc_n_layers))
        self.post_ln = nn.LayerNorm(cfg.enc_dim, eps=1e-5)
        self.proj_mlp = MLP(2 * cfg.enc_dim, cfg.proj_inner_dim, cfg.proj_out_dim)

    def encode(self, crops_BCHW: torch.Tensor) -> torch.Tensor:
        """Normalised crops (B, 3, C, C) -> patch features (B, n_patches, enc_dim)."""
        b, ch, h, w = crops_BCHW.shape
        p = self.cfg.enc_patch_size
        # Patch vectors are flattened in (channel, row, column) order, as the checkpoint expects.
        x = crops_BCHW.reshape(b, ch, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_emb(x.reshape(b, (h // p) * (w // p), ch * p * p)) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.post_ln(x)

    def project(self, feats_BND: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """Encoder output of [global, tiles...] -> image tokens (n_patches, text dim)."""
        g, d = self.cfg.grid, self.cfg.enc_dim
        local = reconstruct(feats_BND[1:].view(-1, g, g, d), tiling, self.cfg.overlap_margin)
        pooled = F.adaptive_avg_pool2d(local.permute(2, 0, 1), (g, g)).permute(1, 2, 0).reshape(g * g, d)
        return self.proj_mlp(torch.cat([feats_BND[0], pooled], dim=-1))

    def forward(self, crops_BCHW: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        return self.project(self.encode(crops_BCHW), tiling)
