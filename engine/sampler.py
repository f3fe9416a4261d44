"""Token sampling: greedy, or temperature + top-p, batched, on the device, without a host sync.

Randomness is a uniform number per (request seed, decode step), computed on the host with a
counter-based hash and shipped with the step's inputs. A request's samples therefore do not
depend on which other requests share its batch, on pipelining, or on the device's RNG state:
the reference decoder and the engine draw the same tokens for the same seed.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def step_uniform(seed: int, step: int) -> float:
    """Uniform in [0, 1) from (seed, step) via splitmix64; exactly representable in fp32."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 40) / float(1 << 24)


def suppress(logits_BV: torch.Tensor, token_id: int, rows_B: torch.Tensor) -> torch.Tensor:
    """Set logits[b, token_id] = -inf where rows_B[b] is True (in place)."""
    col = logits_BV[:, token_id]
    logits_BV[:, token_id] = torch.where(rows_B, torch.full_like(col, float("-inf")), col)
    return logits_BV


def sample(
    logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor, u_B: torch.Tensor,
    all_greedy: bool = False,
) -> torch.Tensor:
    """Next token per row (int64, shape (B,)).

    Rows with temperature 0 take the argmax (first index among ties). Others keep the smallest
    set of most probable tokens whose mass reaches top_p (a token stays if the mass before it is
    <= top_p) and invert that distribution's CDF at u.
    """
    logits = logits_BV.float()
    greedy = logits.argmax(dim=-1)
    if all_greedy:  # known on the host: skip the sampling kernels altogether
        return greedy
    t = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B)).float()
    probs = torch.softmax(logits / t[:, None], dim=-1)
    p_sorted, idx = probs.sort(dim=-1, descending=True, stable=True)
    before = p_sorted.cumsum(dim=-1) - p_sorted
    p_sorted = torch.where(before > top_p_B.float()[:, None], torch.zeros_like(p_sorted), p_sorted)
    cdf = p_sorted.cumsum(dim=-1)
    target = (u_B.float() * cdf[:, -1]).unsqueeze(1)
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    # Past the kept set's total only through rounding: fall back to the last kept token.
    kept = (p_sorted > 0).sum(dim=-1, keepdim=True) - 1
    pick = torch.minimum(pick, kept)
    sampled = idx.gather(1, pick).squeeze(1)
    return torch.where(temperature_B > 0, sampled, greedy)


def apply_constraints(logits_RV: torch.Tensor, groups: list, fsm_state: torch.Tensor) -> list:
    """Mask constrained rows in place; return what `advance_constraints` needs after sampling.

    groups: (automaton, row indices (G,), state slots (G,), first-token flags (G,)). A row
    sampling its first answer token starts in state 0; later rows continue from fsm_state[slot],
    which the previous step left on the device.
    """
    out = []
    for automaton, rows, slots, first in groups:
        states = torch.where(first, torch.zeros_like(slots), fsm_state[slots])
        sub = logits_RV[rows]
        sub.masked_fill_(~automaton.allowed(states), float("-inf"))
        logits_RV[rows] = sub
        out.append((automaton, rows, slots, states))
    return out


def advance_constraints(tokens_R: torch.Tensor, masked: list, fsm_state: torch.Tensor) -> None:
    for automaton, rows, slots, states in masked:
        fsm_state[slots] = automaton.advance(states, tokens_R[rows])
