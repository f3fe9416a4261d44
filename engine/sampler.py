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

    Rows with temperature 0 take the argmax (first index among ties). Others keep every token
    whose strictly more probable tokens weigh at most top_p (the nucleus; tokens of equal
    probability are kept or dropped together) and invert that distribution's CDF at u, summing
    in vocabulary order. The definition needs no sort, so a kernel can compute it in passes over
    the vocabulary (`engine.kernels.sampling`); this function is its reference.
    """
    logits = logits_BV.float()
    greedy = logits.argmax(dim=-1)
    if all_greedy:  # known on the host: skip the sampling kernels altogether
        return greedy
    t = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B)).float()
    # A model whose weights hold NaN (a diverged training run) gives NaN logits: its tokens are
    # garbage but in range (an index past the vocabulary stopped the engine for every request).
    probs = torch.softmax(logits / t[:, None], dim=-1).nan_to_num_(nan=0.0)
    p_sorted = probs.sort(dim=-1, descending=True).values
    # Mass of the strictly more probable tokens, for each sorted entry: the exclusive cumulative
    # sum at the first entry of its group of equal values.
    before = p_sorted.cumsum(dim=-1) - p_sorted
    first = torch.searchsorted(-p_sorted, -p_sorted, right=False)
    greater = before.gather(1, first)
    n_kept = (greater <= top_p_B.float()[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = p_sorted.gather(1, n_kept - 1)
    kept = (probs >= threshold) & (probs > 0)
    cdf = (probs * kept).cumsum(dim=-1)
    target = u_B.float()[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True)
    # Past the kept total only through rounding: fall back to the last kept token.
    last = kept.shape[-1] - 1 - kept.flip(-1).int().argmax(dim=-1, keepdim=True)
    sampled = torch.minimum(pick, last).squeeze(1)
    return torch.where(temperature_B > 0, sampled, greedy)


def stick(tokens_R: torch.Tensor, logits_RV: torch.Tensor, prefer_R: torch.Tensor,
          margin_R: torch.Tensor) -> torch.Tensor:
    """Rows with a preferred token (prefer_R >= 0) take it where its logit is within margin_R of
    the row's best (SamplingParams.sticky); other rows keep their sampled token."""
    logits = logits_RV.float()
    best = logits.max(dim=-1).values
    mine = logits.gather(1, prefer_R.clamp(min=0)[:, None])[:, 0]
    return torch.where((prefer_R >= 0) & (mine >= best - margin_R), prefer_R, tokens_R)


def apply_constraints(logits_RV: torch.Tensor, groups: list, fsm_state: torch.Tensor) -> list:
    """Mask constrained rows in place; return what `advance_constraints` needs after sampling.

    groups: (automaton, row indices (G,), state slots (G,), first-token flags (G,)). A row
    sampling its first answer token starts in state 0; later rows continue from fsm_state[slot],
    which the previous step left on the device.
    """
    out = _states(groups, fsm_state)
    for automaton, rows, _, states in out:
        sub = logits_RV[rows]
        sub.masked_fill_(~automaton.allowed(states), float("-inf"))
        logits_RV[rows] = sub
    return out


def constraint_mask(logits_RV: torch.Tensor, groups: list, fsm_state: torch.Tensor) -> tuple:
    """For the fused sampling kernel: (uint8 (R, V) mask or None, what `advance_constraints` needs)."""
    if not groups:
        return None, []
    allowed = torch.ones(logits_RV.shape, dtype=torch.uint8, device=logits_RV.device)
    out = _states(groups, fsm_state)
    for automaton, rows, _, states in out:
        allowed[rows] = automaton.allowed(states).to(torch.uint8)
    return allowed, out


def _states(groups: list, fsm_state: torch.Tensor) -> list:
    """(automaton, rows, slots, states) per group: state 0 for a first token, else the slot's state."""
    return [(automaton, rows, slots, torch.where(first, torch.zeros_like(slots), fsm_state[slots]))
            for automaton, rows, slots, first in groups]


def advance_constraints(tokens_R: torch.Tensor, masked: list, fsm_state: torch.Tensor) -> None:
    for automaton, rows, slots, states in masked:
        fsm_state[slots] = automaton.advance(states, tokens_R[rows])
