"""Fused sampling: constraint mask, answer-marker suppression, temperature, top-p and the draw
(or argmax), one program per row, in passes over the vocabulary; nothing goes to the host.

The function is `engine.sampler.sample` (its PyTorch reference) applied to logits masked where
`allowed_RV` is 0 and, for rows with `suppress_R` set, at `suppress_id`. The nucleus threshold is
found without a sort: the kept set is {p >= tau}, tau the smallest probability whose strictly
greater mass is <= top_p, and since that mass only shrinks as the value grows, tau is found by
bisection over the bit patterns of non-negative floats (31 halvings give the exact float). The
draw inverts the kept distribution's CDF in vocabulary order at u, as the reference does. Sums
run in a different order than the reference's cumulative sums, so a row whose u or top_p falls
within float rounding of a boundary may pick the neighbouring token (tests bound this).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sampler import sample, suppress


def sample_reference(logits_RV: torch.Tensor, allowed_RV: torch.Tensor | None, suppress_R: torch.Tensor,
                     suppress_id: int, temperature_R: torch.Tensor, top_p_R: torch.Tensor,
                     u_R: torch.Tensor) -> torch.Tensor:
    logits = logits_RV.float().clone()
    if allowed_RV is not None:
        logits.masked_fill_(allowed_RV == 0, float("-inf"))
    suppress(logits, suppress_id, suppress_R)
    return sample(logits, temperature_R, top_p_R, u_R)


@triton.jit
def _masked(logits_ptr, allowed_ptr, offs, ok, sup, suppress_id, HAS_ALLOWED: tl.constexpr):
    x = tl.load(logits_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_ALLOWED:
        a = tl.load(allowed_ptr + offs, mask=ok, other=0)
        x = tl.where(a != 0, x, float("-inf"))
    return tl.where(sup & (offs == suppress_id), float("-inf"), x)


@triton.jit
def _probs(logits_ptr, allowed_ptr, offs, ok, sup, suppress_id, m, inv_t, log_z, HAS_ALLOWED: tl.constexpr):
    x = _masked(logits_ptr, allowed_ptr, offs, ok, sup, suppress_id, HAS_ALLOWED)
    return tl.where(ok, tl.exp((x - m) * inv_t - log_z), 0.0)


@triton.jit
def _sample_kernel(logits_ptr, allowed_ptr, sup_ptr, temp_ptr, top_p_ptr, u_ptr, out_ptr,
                   stride_l, stride_a, V, suppress_id,
                   HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr):
    r = tl.program_id(0)
    row = logits_ptr + r * stride_l
    arow = allowed_ptr + r * stride_a
    sup = tl.load(sup_ptr + r) != 0
    temp = tl.load(temp_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    u = tl.load(u_ptr + r)
    idx = tl.arange(0, BLOCK)

    # Pass 1: maximum (and its first index: the greedy token).
    m = tl.full((), float("-inf"), tl.float32)
    best = tl.full((), V, tl.int32)
    for i in range(N_BLOCKS):
        offs = i * BLOCK + idx
        ok = offs < V
        x = _masked(row, arow, offs, ok, sup, suppress_id, HAS_ALLOWED)
        bm = tl.max(x, axis=0)
        bi = tl.min(tl.where(x == bm, offs, V), axis=0)
        better = bm > m
        best = tl.where(better, bi, best)
        m = tl.maximum(m, bm)
    if temp > 0:
        inv_t = 1.0 / temp
        # Pass 2: normaliser, so every later pass recomputes the very same probabilities.
        z = tl.full((), 0.0, tl.float32)
        for i in range(N_BLOCKS):
            offs = i * BLOCK + idx
            ok = offs < V
            p = _probs(row, arow, offs, ok, sup, suppress_id, m, inv_t, 0.0, HAS_ALLOWED)
            z += tl.sum(p, axis=0)
        log_z = tl.log(z)
        # Bisection on float bits: smallest tau with (mass of p > tau) <= top_p.
        lo = tl.full((), 0, tl.int32)
        hi = tl.full((), 0x3F800000, tl.int32)  # 1.0: no probability is above it
        for _ in range(31):
            mid = (lo + hi) // 2
            x_mid = mid.to(tl.float32, bitcast=True)
            above = tl.full((), 0.0, tl.float32)
            for i in range(N_BLOCKS):
                offs = i * BLOCK + idx
                ok = offs < V
                p = _probs(row, arow, offs, ok, sup, suppress_id, m, inv_t, log_z, HAS_ALLOWED)
                above += tl.sum(tl.where(p > x_mid, p, 0.0), axis=0)
            fits = above <= top_p
            hi = tl.where(fits, mid, hi)
            lo = tl.where(fits, lo, mid + 1)
        tau = hi.to(tl.float32, bitcast=True)
        # Kept mass, then the first index whose running kept mass exceeds u * total.
        total = tl.full((), 0.0, tl.float32)
        last = tl.full((), -1, tl.int32)
        for i in range(N_BLOCKS):
            offs = i * BLOCK + idx
            ok = offs < V
            p = _probs(row, arow, offs, ok, sup, suppress_id, m, inv_t, log_z, HAS_ALLOWED)
            kept = (p >= tau) & (p > 0)
            total += tl.sum(tl.where(kept, p, 0.0), axis=0)
            last = tl.maximum(last, tl.max(tl.where(kept, offs, -1), axis=0))
        target = u * total
        run = tl.full((), 0.0, tl.float32)
        pick = tl.full((), V, tl.int32)
        for i in range(N_BLOCKS):
            offs = i * BLOCK + idx
            ok = offs < V
            p = _probs(row, arow, offs, ok, sup, suppress_id, m, inv_t, log_z, HAS_ALLOWED)
            pk = tl.where((p >= tau) & (p > 0), p, 0.0)
            cdf = tl.cumsum(pk, axis=0) + run
            pick = tl.minimum(pick, tl.min(tl.where(ok & (cdf > target), offs, V), axis=0))
            run += tl.sum(pk, axis=0)
        best = tl.minimum(pick, last)
    tl.store(out_ptr + r, best.to(tl.int64))


def launch_constants(vocab_size: int, has_allowed: bool, block: int = 2048) -> dict:
    """The kernel's compile-time parameters (also used to compile it ahead of time)."""
    block = min(block, triton.next_power_of_2(vocab_size))
    return dict(HAS_ALLOWED=has_allowed, BLOCK=block, N_BLOCKS=triton.cdiv(vocab_size, block))


def sample_triton(logits_RV: torch.Tensor, allowed_RV: torch.Tensor | None, suppress_R: torch.Tensor,
                  suppress_id: int, temperature_R: torch.Tensor, top_p_R: torch.Tensor, u_R: torch.Tensor,
                  block: int = 2048, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel: int64 (R,) tokens. `allowed_RV` uint8/bool (nonzero = allowed) or None."""
    r, v = logits_RV.shape
    out = torch.empty(r, dtype=torch.int64, device=logits_RV.device) if out is None else out
    if r == 0:
        return out
    logits = logits_RV.contiguous()
    allowed = allowed_RV.contiguous().view(torch.uint8) if allowed_RV is not None else logits
    _sample_kernel[(r,)](
        logits, allowed, suppress_R.to(torch.int8), temperature_R.float().contiguous(),
        top_p_R.float().contiguous(), u_R.float().contiguous(), out,
        logits.stride(0), allowed.stride(0), v, suppress_id, **launch_constants(v, allowed_RV is not None, block))
    return out
