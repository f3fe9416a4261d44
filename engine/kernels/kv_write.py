"""The new tokens' keys and values into their KV-cache slots (one layer).

`k_cache`/`v_cache`: (n_slots, n_kv_heads, head_dim); `k_new`/`v_new`: (N, n_kv_heads, head_dim);
`slots`: (N,) flat slot of each new token. Slots are distinct within a call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def kv_write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       slots_N: torch.Tensor) -> None:
    k_cache.index_copy_(0, slots_N.long(), k_new.to(k_cache.dtype))
    v_cache.index_copy_(0, slots_N.long(), v_new.to(v_cache.dtype))


@triton.jit
def _kv_write_kernel(k_cache, v_cache, k_new, v_new, slots, stride_cache, stride_new, n_elems,
                     BLOCK: tl.constexpr):
    n = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_elems
    slot = tl.load(slots + n).to(tl.int64)
    k = tl.load(k_new + n * stride_new + offs, mask=ok)
    v = tl.load(v_new + n * stride_new + offs, mask=ok)
    tl.store(k_cache + slot * stride_cache + offs, k.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(v_cache + slot * stride_cache + offs, v.to(v_cache.dtype.element_ty), mask=ok)


def launch_constants(n_kv_heads: int, head_dim: int) -> dict:
    """The kernel's compile-time parameters for a layout (also used to compile it ahead of time)."""
    return dict(BLOCK=triton.next_power_of_2(n_kv_heads * head_dim))


def kv_write_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    slots_N: torch.Tensor) -> None:
    """One program per new token; each copies n_kv_heads * head_dim contiguous values."""
    n, hk, d = k_new.shape
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kv_write_triton needs contiguous caches")
    if n == 0:
        return
    _kv_write_kernel[(n,)](k_cache, v_cache, k_new, v_new, slots_N, k_cache.stride(0), k_new.stride(0),
                           hk * d, **launch_constants(hk, d))
