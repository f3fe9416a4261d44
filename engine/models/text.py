"""Phi-style text decoder: parallel attention + MLP blocks, partial rotary, untied lm_head.

The decoder does not own a KV cache. `TextModel.forward` computes q/k/v for the new tokens and
hands them, rotated, to an `attend(layer, q, k, v)` callback that stores k/v wherever its caller
keeps them (a contiguous buffer in the reference decoder, paged blocks in the engine) and returns
the attention output. Parameter names follow the checkpoint keys under `model.text.`.

Batch invariance (fp32 on CPU): a row's result must not depend on which other rows share its
batch, or the engine could not match the reference decoder token for token. CPU GEMMs change
kernels (and rounding) below some number of rows, so linears see at least that many rows (zero
rows are padded in). The number depends on the CPU and the GEMM's input width: 4 on the AMD
EPYCs this was first measured on; on an Intel Xeon with AMX, 9 for inputs `dim` wide and 16 for
the MLP's second linear (`ff_dim` wide). `gemm_min_rows` measures both for the model's own
shapes when the model is loaded (`TextModel.min_rows`, `min_rows_ff`).
Single-query attention (decode) through SDPA is invariant to batch and to the padded key length
as long as that length is a multiple of `KV_ALIGN`; multi-query attention (prefill) is not, so
with `exact=True` it reduces in fp64, whose fp32 result does not depend on shapes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TextConfig
from .vision import MLP, gelu_tanh, sdpa

# attend(layer, q_BHTD, k_BKTD, v_BKTD) -> out_BHTD
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ROPE_THETA = 10000.0
MIN_GEMM_ROWS = 4
KV_ALIGN = 16


def padded_rows(n: int, min_rows: int, bucket: bool) -> int:
    """The rows a linear runs over for n real rows: at least min_rows; with `bucket`, n rounded up
    to a multiple of 8, and from 128 rows on to one of 8 sizes per doubling (128, 144, ..., 256,
    288, ...: at most 1/8 more).

    Why buckets (bf16 on CPU): oneDNN builds a kernel for every new shape of a bf16 matmul, ~1.3
    ms the first time, and keeps it in its cache of up to 1024 kernels with ~0.75 MB of memory
    each. A live stream's steps come in dozens of row counts (draft rows vary), so a run kept
    stalling on new shapes and its memory grew by ~100 MB in 16 minutes (BENCHMARKS.md).
    TorchScript compiles this function too (scripted.py).
    """
    if n < min_rows:
        n = min_rows
    if not bucket:
        return n
    g = 8
    while g * 16 <= n:
        g *= 2
    return (n + g - 1) // g * g


def rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_rows: int,
                   bucket: bool = False) -> torch.Tensor:
    """fn over the last dim of x, over `padded_rows` rows so the GEMM kernel is fixed."""
    lead, c = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, c)
    n = x2.shape[0]
    rows = padded_rows(n, min_rows, bucket)
    if rows > n:
        x2 = torch.cat([x2, x2.new_zeros(rows - n, c)])
    return fn(x2)[:n].reshape(*lead, -1)


# Row counts probed, and the count whose result the others are held to.
_PROBE_ROWS = (*range(1, 21), 24, 32, 48, 64, 128)
_PROBE_REF = 256


def gemm_min_rows(cfg: TextConfig, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """The fewest rows from which this CPU's fp32 GEMMs give every row the same result whatever
    the number of rows: for the linears whose inputs are `dim` wide (qkv, proj, fc1, lm_head),
    and for fc2 (`ff_dim` wide). MIN_GEMM_ROWS where no exactness is promised (other dtypes,
    GPUs)."""
    if device.type != "cpu" or dtype != torch.float32:
        return MIN_GEMM_ROWS, MIN_GEMM_ROWS
    narrow = ((cfg.qkv_dim, cfg.dim), (cfg.dim, cfg.dim), (cfg.ff_dim, cfg.dim), (cfg.vocab_size, cfg.dim))
    return _probe_min_rows(narrow), _probe_min_rows(((cfg.dim, cfg.ff_dim),))


@lru_cache(maxsize=None)
def _probe_min_rows(shapes: tuple[tuple[int, int], ...]) -> int:
    need = MIN_GEMM_ROWS
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n_out, n_in in shapes:
            w, b = torch.randn(n_out, n_in, generator=g), torch.randn(n_out, generator=g)
            x = torch.randn(_PROBE_REF, n_in, generator=g)
            ref = F.linear(x, w, b)
            for m in _PROBE_ROWS:
                if not torch.equal(F.linear(x[:m], w, b), ref[:m]):
                    need = max(need, m + 1)
    return need


def attention(q_BHTD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor,
              mask: torch.Tensor | None, exact: bool) -> torch.Tensor:
    """Scaled dot-product attention; grouped-query when K < H. `exact`: batch invariant (see top)."""
    if not exact or q_BHTD.shape[2] == 1:
        return sdpa(q_BHTD, k_BKLD, v_BKLD, attn_mask=mask, enable_gqa=q_BHTD.shape[1] != k_BKLD.shape[1])
    group = q_BHTD.shape[1] // k_BKLD.shape[1]
    k = k_BKLD.double().repeat_interleave(group, dim=1) if group > 1 else k_BKLD.double()
    v = v_BKLD.double().repeat_interleave(group, dim=1) if group > 1 else v_BKLD.double()
    scores = torch.matmul(q_BHTD.double(), k.transpose(-1, -2)) * (q_BHTD.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(q_BHTD.dtype)


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
        # Rows every linear sees at least (dim-wide inputs; fc2's): the loader measures them.
        self.min_rows = self.min_rows_ff = MIN_GEMM_ROWS
        self.row_buckets = False  # `padded_rows`; the loader turns it on for bf16/fp16 on CPU

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (max_context, rot_dim / 2), fp32, cached per device."""
        if device not in self._rope:
            rot = self.cfg.rot_dim
            freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, rot, 2, dtype=torch.float32)[: rot // 2] / rot))
            angles = torch.arange(self.cfg.max_context, dtype=torch.float32).unsqueeze(1) * freqs.unsqueeze(0)
            cis = torch.exp(1j * angles)
            self._rope[device] = (cis.real.contiguous().to(device), cis.imag.contiguous().to(device))
        return self._rope[device]

    def rotate(self, x_BTHD: torch.Tensor, cos_BT1R: torch.Tensor, sin_BT1R: torch.Tensor) -> torch.Tensor:
        """Rotary on the first rot_dim dims of each head, pairs (i, i + rot_dim/2).

        The rotated pairs are written back interleaved, as the reference does; attention
        scores are the same in any layout applied alike to q and k.
        """
        rot = self.cfg.rot_dim
        x_rot, x_pass = x_BTHD[..., :rot], x_BTHD[..., rot:]
        xr, xi = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        out = torch.stack((xr * cos_BT1R - xi * sin_BT1R, xr * sin_BT1R + xi * cos_BT1R), dim=-1).flatten(-2)
        return torch.cat([out.to(x_BTHD.dtype), x_pass], dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    def forward(self, x_BTC: torch.Tensor, pos_BT: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Hidden states after all blocks (before post_ln) for inputs at positions pos_BT."""
        cfg = self.cfg
        b, t, _ = x_BTC.shape
        h_q, h_kv = cfg.n_heads, cfg.n_kv_heads
        cos, sin = self.rope_tables(x_BTC.device)
        cos, sin = cos[pos_BT].unsqueeze(2), sin[pos_BT].unsqueeze(2)  # (B, T, 1, rot/2)
        for i, block in enumerate(self.blocks):
            h = block.ln(x_BTC)
            qkv = rows_invariant(block.attn.qkv, h, self.min_rows, self.row_buckets)
            qkv = qkv.view(b, t, h_q + 2 * h_kv, cfg.head_dim)
            qk = self.rotate(qkv[:, :, : h_q + h_kv], cos, sin)  # q and k heads in one pass
            q, k = qk[:, :, :h_q].transpose(1, 2), qk[:, :, h_q:].transpose(1, 2)
            v = qkv[:, :, h_q + h_kv :].transpose(1, 2)
            a = attend(i, q, k, v).transpose(1, 2).reshape(b, t, cfg.dim)
            x_BTC = (x_BTC + rows_invariant(block.attn.proj, a, self.min_rows, self.row_buckets)
                     + rows_invariant(lambda x: self._mlp(block.mlp, x), h, self.min_rows, self.row_buckets))
        return x_BTC

    def _mlp(self, mlp: MLP, x2: torch.Tensor) -> torch.Tensor:
        return rows_invariant(mlp.fc2, gelu_tanh(mlp.fc1(x2)), self.min_rows_ff, self.row_buckets)

    def logits(self, h_BC: torch.Tensor) -> torch.Tensor:
        return rows_invariant(self.lm_head, self.post_ln(h_BC), self.min_rows, self.row_buckets)


def attention_mask(q_pos_T: torch.Tensor, kv_len: int, prefix_len: int) -> torch.Tensor:
    """Boolean (T, kv_len) mask: causal, except that the image prefix sees itself bidirectionally."""
    kv_pos = torch.arange(kv_len, device=q_pos_T.device)
    q = q_pos_T.unsqueeze(1)
    return (kv_pos <= q) | ((q < prefix_len) & (kv_pos < prefix_len))
