import math

import torch

from engine.sampler import sample, step_uniform, stick, suppress


def _logits(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


def test_greedy_takes_first_maximum():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 1.0, 1.0]])
    out = sample(logits, torch.zeros(2), torch.full((2,), 0.3), torch.tensor([0.9, 0.1]))
    assert out.tolist() == [1, 0]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = _logits([[0.2, 0.5, 0.3]]).expand(3, 3)
    t, p = torch.ones(3), torch.full((3,), 0.6)
    # kept: 0.5 (mass before 0) and 0.3 (mass before 0.5 <= 0.6); 0.2 dropped.
    # CDF in vocabulary order over the kept tokens 1, 2: 0.625 | 1.0
    out = sample(logits, t, p, torch.tensor([0.0, 0.6, 0.99]))
    assert out.tolist() == [1, 1, 2]
    assert 0 not in sample(logits, t, p, torch.tensor([0.7, 0.8, 0.999999])).tolist()


def test_sampled_frequencies_follow_the_distribution():
    probs = [0.1, 0.4, 0.2, 0.3]
    n = 4000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    out = sample(_logits([probs]).expand(n, 4), torch.ones(n), torch.ones(n), u)
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor(probs), atol=0.002)


def test_temperature_sharpens():
    n = 2000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    logits = _logits([[0.6, 0.4]]).expand(n, 2)
    cold = sample(logits, torch.full((n,), 0.25), torch.ones(n), u)
    p0 = 0.6 ** 4 / (0.6 ** 4 + 0.4 ** 4)
    assert math.isclose((cold == 0).float().mean().item(), p0, abs_tol=0.002)


def test_mixed_batch_greedy_and_sampled_rows():
    logits = _logits([[0.3, 0.7], [0.3, 0.7]])
    # In vocabulary order the CDF is [0.3 (token 0), 1.0 (token 1)]: u = 0.2 samples token 0.
    out = sample(logits, torch.tensor([0.0, 1.0]), torch.ones(2), torch.tensor([0.2, 0.2]))
    assert out.tolist() == [1, 0]


def test_tokens_of_equal_probability_are_kept_together():
    # 0.4 | 0.3 0.3: with top_p 0.5 both 0.3 tokens have 0.4 before them and are kept.
    logits = _logits([[0.3, 0.4, 0.3]]).expand(3, 3)
    out = sample(logits, torch.ones(3), torch.full((3,), 0.5), torch.tensor([0.1, 0.5, 0.9]))
    assert out.tolist() == [0, 1, 2]
    # With top_p 0.3 only the most probable token stays.
    out = sample(logits, torch.ones(3), torch.full((3,), 0.3), torch.tensor([0.1, 0.5, 0.9]))
    assert out.tolist() == [1, 1, 1]


def test_masked_tokens_are_never_sampled():
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 1.0]]).expand(64, 4)
    u = (torch.arange(64, dtype=torch.float32) + 0.5) / 64
    out = sample(logits, torch.ones(64), torch.ones(64), u)
    assert set(out.tolist()) == {1, 3}
    # A draw past the kept mass through rounding (u at its top) falls back to the last kept
    # token, not to the last of the vocabulary, which a constraint masked
    masked_last = torch.tensor([[1.0, 2.0, float("-inf")]])
    assert sample(masked_last, torch.ones(1), torch.ones(1), torch.tensor([1.0])).tolist() == [1]


def test_step_uniform():
    values = [step_uniform(s, k) for s in range(20) for k in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) > 990
    assert step_uniform(7, 3) == step_uniform(7, 3)
    assert abs(sum(values) / len(values) - 0.5) < 0.03


def test_suppress_only_selected_rows():
    logits = torch.zeros(2, 5)
    suppress(logits, 3, torch.tensor([True, False]))
    assert logits[0, 3] == float("-inf") and logits[1, 3] == 0 and logits[0, 2] == 0


def test_nan_logits_give_tokens_in_the_vocabulary():
    """A diverged model's NaN logits made an index past the vocabulary (466 of 466), and the
    engine stopped for every request."""
    logits = torch.randn(4, 50)
    logits[0] = float("nan")
    logits[1, 7] = float("nan")
    out = sample(logits, torch.tensor([1.0, 0.7, 0.0, 1.0]), torch.tensor([0.9, 1.0, 0.5, 0.3]),
                 torch.tensor([0.999, 0.5, 0.1, 0.0]))
    assert out.shape == (4,) and bool(((out >= 0) & (out < 50)).all())


def test_tokens_whose_more_probable_tokens_weigh_exactly_top_p_are_kept():
    logits = _logits([[0.25, 0.5, 0.25]]).expand(3, 3)
    assert torch.softmax(logits[0], -1).tolist() == [0.25, 0.5, 0.25]  # exact in fp32: no rounding at the edge
    # the 0.25 tokens have 0.5 before them: "at most top_p" keeps them at top_p 0.5
    out = sample(logits, torch.ones(3), torch.full((3,), 0.5), torch.tensor([0.1, 0.5, 0.9]))
    assert out.tolist() == [0, 1, 2]


def test_a_seeds_draws_are_the_same_in_every_version():
    """A result records its seed (`with_seed`) so that a run can be repeated: the draws for a
    seed are fixed values, not whatever the hash happens to give today."""
    pinned = {(0, 0): 8522164, (0, 1): 7087018, (42, 0): 9296213, (42, 1): 8678545, (2**63 - 1, 767): 8259905}
    assert {k: step_uniform(*k) * 2**24 for k in pinned} == pinned


def test_sticky_keeps_the_preferred_token_within_its_margin_and_no_further():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]]).expand(5, 4)
    greedy = torch.ones(5, dtype=torch.int64)
    prefer = torch.tensor([2, 2, 0, 0, -1])
    # 2 is 0.5 below the best: kept at margin 0.5 exactly (at most `sticky` above), not at 0.25;
    # token 0 (2 below) is a token like any other; -1 (no draft) keeps the sampled token
    margin = torch.tensor([0.5, 0.25, 2.0, 1.5, 10.0])
    assert stick(greedy, logits, prefer, margin).tolist() == [2, 1, 0, 1, 1]
