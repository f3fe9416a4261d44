"""Decode attention over a paged KV cache: one query token per row, grouped-query ready.

Layout (the engine's): `k_cache`/`v_cache` of one layer are (n_slots, n_kv_heads, head_dim) with
slot = page * page_size + offset; row b's position p lives in page `page_table[b, p // page_size]`.
Row b attends to its positions 0 .. seq_lens[b] - 1. For a decode query that is the whole
Moondream 2 mask: the image prefix (bidirectional among itself) and every earlier answer token
are all before the query, so causal and prefix masks agree. Entries of `page_table` past a row's
last page are never read by the kernel (the reference reads and masks them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def paged_attention_reference(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              page_table_BP: torch.Tensor, seq_lens_B: torch.Tensor, page_size: int,
                              scale: float) -> torch.Tensor:
    """PyTorch: gather whole pages, mask past seq_len, softmax in fp32. Returns (B, H, D) in q's dtype."""
    b, h, d = q_BHD.shape
    hk = k_cache.shape[1]
    n_pages = page_table_BP.shape[1]
    pages = page_table_BP.long().reshape(-1)
    keys = k_cache.view(-1, page_size, hk, d).index_select(0, pages).view(b, n_pages * page_size, hk, d)
    values = v_cache.view(-1, page_size, hk, d).index_select(0, pages).view(b, n_pages * page_size, hk, d)
    group = h // hk
    keys = keys.float().repeat_interleave(group, dim=2)  # (B, L, H, D)
    values = values.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q_BHD.float(), keys) * scale
    valid = torch.arange(keys.shape[1], device=q_BHD.device)[None, :] < seq_lens_B[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(scores, dim=-1), values).to(q_BHD.dtype)


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr,
                            stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
                            scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                            PAGE: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    dim = tl.arange(0, HEAD_DIM)
    tok = tl.arange(0, PAGE)
    g_ok = g < GROUP
    heads = hk * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dim[None, :], mask=g_ok[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    seq_len = tl.load(lens_ptr + b)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    for p in range(0, tl.cdiv(seq_len, PAGE)):
        page = tl.load(table_ptr + b * stride_tb + p).to(tl.int64)
        slots = page * PAGE + tok
        valid = p * PAGE + tok < seq_len
        kv_off = slots[:, None] * stride_ks + hk * stride_kh + dim[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)  # (PAGE, D)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, PAGE)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dim[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def launch_constants(n_heads: int, n_kv_heads: int, head_dim: int, page_size: int) -> dict:
    """The kernel's compile-time parameters for a layout (also used to compile it ahead of time)."""
    group = n_heads // n_kv_heads
    return dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, PAGE=page_size)


def paged_attention_triton(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table_BP: torch.Tensor, seq_lens_B: torch.Tensor, page_size: int,
                           scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel: one program per (row, kv head), online softmax over the row's pages only."""
    b, h, d = q_BHD.shape
    hk = k_cache.shape[1]
    if h % hk or d & (d - 1) or page_size & (page_size - 1):
        raise ValueError("paged_attention_triton needs heads % kv_heads == 0 and power-of-two head_dim and page_size")
    if k_cache.stride(2) != 1 or q_BHD.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_attention_triton needs the last dim contiguous and k/v caches of one layout")
    out = torch.empty_like(q_BHD) if out is None else out
    _paged_attention_kernel[(b, hk)](
        q_BHD, k_cache, v_cache, page_table_BP, seq_lens_B, out,
        q_BHD.stride(0), q_BHD.stride(1), k_cache.stride(0), k_cache.stride(1), page_table_BP.stride(0),
        out.stride(0), out.stride(1), scale, **launch_constants(h, hk, d, page_size))
    return out
