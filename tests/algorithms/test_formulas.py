"""The framework-free formulas against hand-computed values (no verl here)."""

import math

import pytest
import torch

from zero_mismatch_plugin.algorithms import formulas

pytestmark = pytest.mark.quick


def test_outcome_reward_sums_over_the_mask():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    assert formulas.outcome_reward(rewards, mask).tolist() == [1.0, 2.0]


def test_group_centered_advantage_excludes_padding_and_zeroes_singletons():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 7.0, 100.0])
    group_ids = torch.tensor([0, 0, 0, 1, 2, 0])  # row 5 is padding sharing group 0
    valid = torch.tensor([True, True, True, True, True, False])
    advantages, singleton = formulas.group_centered_advantage(rewards, group_ids, valid)
    third = 1.0 / 3.0
    assert torch.allclose(advantages, torch.tensor([1 - third, -third, -third, 0.0, 0.0, 0.0]))
    assert singleton.tolist() == [False, False, False, True, True, False]


def test_group_centered_advantage_has_no_std_normalisation():
    advantages, _ = formulas.group_centered_advantage(
        torch.tensor([10.0, 0.0]), torch.tensor([0, 0]), torch.tensor([True, True]))
    assert advantages.tolist() == [5.0, -5.0]


def test_batch_centered_advantage_ignores_padding():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 50.0])
    valid = torch.tensor([True, True, True, True, False])
    advantages = formulas.batch_centered_advantage(rewards, valid)
    assert torch.allclose(advantages, torch.tensor([0.25, -0.75, 0.25, 0.25, 0.0]))


def test_sequence_mean_token_mean_weights_rows_equally():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    # (1 + 4 + 0) / 3: the empty row still counts in B.
    assert formulas.sequence_mean_token_mean(values, mask).item() == pytest.approx(5.0 / 3.0)
    assert formulas.sequence_mean_token_mean(values, mask, num_sequences=10).item() == pytest.approx(0.5)


def test_reinforce_zero_gradient_is_unclipped_is_reinforce():
    log_mu = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    log_pi = (log_mu + torch.tensor([[3.0, -3.0, 0.7]], dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([2.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    token_loss, capped = formulas.reinforce_zero_token_loss(log_pi, log_mu, advantages)
    formulas.sequence_mean_token_mean(token_loss, mask).backward()
    ratio = torch.exp(log_pi.detach() - log_mu)
    # d/dlogpi of -(1/T) sum A rho = -A rho / T: ratios as large as e^3 are not truncated.
    assert torch.allclose(log_pi.grad, -2.0 * ratio / 3.0)
    assert not capped.any()


def test_log_ratio_cap_is_counted_and_keeps_gradients_finite():
    log_pi = torch.tensor([[80.0, 0.0]], requires_grad=True)
    ratio, capped = formulas.unclipped_importance_ratio(log_pi - torch.zeros(1, 2))
    assert capped.tolist() == [[True, False]]
    assert torch.isfinite(ratio).all()
    ratio.sum().backward()
    assert torch.isfinite(log_pi.grad).all()


def _bernoulli_kl_reference(q: float, p: float) -> float:
    return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))


@pytest.mark.parametrize("q,p", [(0.3, 0.6), (0.9, 0.2), (0.999, 0.99), (1e-6, 1e-3), (0.5, 0.5)])
def test_bernoulli_kl_matches_the_definition(q, p):
    got = formulas.bernoulli_kl(torch.tensor(math.log(q), dtype=torch.float64),
                                torch.tensor(math.log(p), dtype=torch.float64)).item()
    assert got == pytest.approx(_bernoulli_kl_reference(q, p), rel=1e-9, abs=1e-15)


def test_bernoulli_kl_directions_differ_and_are_selectable():
    log_pi, log_mu = torch.tensor([math.log(0.2)]), torch.tensor([math.log(0.7)])
    forward = formulas.sampled_action_bernoulli_kl(log_pi, log_mu, "behaviour_to_learner").item()
    reverse = formulas.sampled_action_bernoulli_kl(log_pi, log_mu, "learner_to_behaviour").item()
    assert forward == pytest.approx(_bernoulli_kl_reference(0.7, 0.2), rel=1e-6)
    assert reverse == pytest.approx(_bernoulli_kl_reference(0.2, 0.7), rel=1e-6)
    with pytest.raises(ValueError, match="behaviour_to_learner"):
        formulas.sampled_action_bernoulli_kl(log_pi, log_mu, "forward")


def test_bernoulli_kl_is_finite_when_one_side_rounds_to_probability_one():
    # fp32 log_softmax returns exactly 0.0 for a near-certain token.
    kl = formulas.bernoulli_kl(torch.tensor([-1e-7, 0.0, -30.0]), torch.tensor([0.0, -1e-7, -1e-30]))
    assert torch.isfinite(kl).all() and (kl >= 0).all()


def test_sequence_trust_region_boundary_is_inclusive():
    token_kl = torch.tensor([[0.01, 0.03], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    admitted, mean_kl = formulas.sequence_trust_region(token_kl, mask, delta=mean_of(0.01, 0.03))
    assert admitted.tolist() == [True, True]
    below = torch.nextafter(mean_kl[0], torch.tensor(-1.0)).item()
    admitted, _ = formulas.sequence_trust_region(token_kl, mask, delta=below)
    assert admitted.tolist() == [False, True]


def mean_of(*values: float) -> float:
    return (torch.tensor(values).sum() / len(values)).item()


def test_flash_reinforce_rejected_rows_have_zero_loss_and_gradient_and_still_count():
    log_mu = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    log_pi = (log_mu + torch.tensor([[0.1, 0.2], [60.0, 60.0]], dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([1.0, 1.0], dtype=torch.float64)
    admitted = torch.tensor([True, False])
    token_loss, _ = formulas.flash_reinforce_token_loss(log_pi, log_mu, advantages, admitted)
    loss = formulas.sequence_mean_token_mean(token_loss, torch.ones(2, 2))
    loss.backward()
    ratio = torch.exp(torch.tensor([0.1, 0.2], dtype=torch.float64))
    assert loss.item() == pytest.approx(-(ratio.mean() / 2).item())  # B = 2, not 1
    assert log_pi.grad[1].tolist() == [0.0, 0.0]


def test_k3_and_effective_sample_size():
    log_ratio = torch.tensor([0.0, math.log(2.0)])
    assert formulas.k3_divergence(log_ratio).tolist() == pytest.approx([0.0, 1.0 - math.log(2.0)])
    mask = torch.ones(2)
    assert formulas.effective_sample_size_fraction(torch.ones(2), mask).item() == pytest.approx(1.0)
    assert formulas.effective_sample_size_fraction(torch.tensor([1.0, 3.0]), mask).item() == pytest.approx(16 / 20)


# ----- padding is selected, never multiplied; 16-bit inputs compute in fp32 ------------------

PADDING_POISONS = [float("nan"), float("inf"), float("-inf"), 3e38]
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


def _poisoned(values: torch.Tensor, poison: float) -> torch.Tensor:
    return torch.where(MASK, values, torch.tensor(poison, dtype=values.dtype))


@pytest.mark.parametrize("poison", PADDING_POISONS)
def test_masked_reductions_never_read_padding(poison):
    values = torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    for reduce in (formulas.outcome_reward,
                   formulas.sequence_mean_token_mean,
                   lambda v, m: formulas.sequence_trust_region(v.abs(), m, delta=1.0)[1],
                   lambda v, m: formulas.effective_sample_size_fraction(v.abs(), m)):
        assert torch.equal(reduce(_poisoned(values, poison), MASK), reduce(values, MASK))


@pytest.mark.parametrize("poison", PADDING_POISONS)
def test_padding_gets_an_exact_zero_gradient_through_masked(poison):
    leaf = _poisoned(torch.full((3, 3), -1.0), poison).requires_grad_(True)
    token_loss, _ = formulas.reinforce_zero_token_loss(formulas.masked(leaf, MASK), torch.zeros(3, 3) - 2.0,
                                                       torch.ones(3))
    formulas.sequence_mean_token_mean(token_loss, MASK).backward()
    assert torch.isfinite(leaf.grad).all() and not leaf.grad[~MASK].any() and leaf.grad[MASK].all()


def test_sequence_mean_token_mean_of_no_rows_is_zero_and_connected():
    values = torch.zeros(0, 4, requires_grad=True)
    loss = formulas.sequence_mean_token_mean(values, torch.zeros(0, 4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and values.grad.shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_log_ratios_are_computed_in_fp32_with_a_cap_the_gradient_dtype_holds(dtype):
    log_mu = torch.tensor([[-12.0, -13.0, -1.0, -70.0]], dtype=dtype)
    log_pi = torch.tensor([[-1.0, -0.5, -1.5, -1.0]], dtype=dtype, requires_grad=True)
    token_loss, capped = formulas.reinforce_zero_token_loss(log_pi, log_mu, torch.ones(1, dtype=dtype))
    assert token_loss.dtype == torch.float32
    formulas.sequence_mean_token_mean(token_loss, torch.ones(1, 4)).backward()
    cap = formulas.log_ratio_cap(dtype)
    log_ratio = log_pi.detach().double() - log_mu.double()
    assert capped.tolist() == (log_ratio > cap).tolist()
    assert torch.equal(token_loss.detach().double(), -torch.exp(log_ratio.clamp(max=cap)).float().double())
    assert log_pi.grad.dtype == dtype and torch.isfinite(log_pi.grad).all()
    # Log-ratios 11, 12.5, -0.5, 69: fp16 caps 12.5 (its exp overflows fp16) and 69; bf16 (cap 50) only 69.
    assert capped.sum().item() == (2 if dtype == torch.float16 else 1)


def test_bernoulli_kl_of_16_bit_inputs_is_returned_in_fp32():
    log_q = torch.tensor([-1e-3, -0.5, -3.0], dtype=torch.float16)
    log_p = torch.tensor([-0.2, -0.5001, -9.0], dtype=torch.float16)
    kl = formulas.bernoulli_kl(log_q, log_p)
    assert kl.dtype == torch.float32
    assert torch.equal(kl, formulas.bernoulli_kl(log_q.float(), log_p.float()))


def test_effective_sample_size_of_capped_ratios_stays_finite():
    # e^50 squared overflows fp32; ESS is scale-free, so it is computed on w / max(w).
    ratio = torch.tensor([1.0, math.exp(50.0)], dtype=torch.float32)
    assert formulas.effective_sample_size_fraction(ratio, torch.ones(2)).item() == pytest.approx(0.5)


# ----- shapes and scalar arguments: refused when wrong, accepted at the edges of their range ----

def test_scalar_arguments_at_the_edges_of_their_range_are_accepted():
    import numpy as np

    token_kl = torch.tensor([[0.0, 0.0], [0.5, 0.1]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert formulas.sequence_trust_region(token_kl, mask, 0.0)[0].tolist() == [True, False]  # only exact rows
    assert formulas.sequence_trust_region(token_kl, mask, math.inf)[0].tolist() == [True, True]
    assert formulas.sequence_trust_region(token_kl, mask, 1)[0].tolist() == [True, True]
    values = torch.tensor([[1.0, 3.0], [4.0, 4.0]])
    expected = formulas.sequence_mean_token_mean(values, mask, num_sequences=4)
    for count in (4.0, np.int64(4)):
        assert torch.equal(formulas.sequence_mean_token_mean(values, mask, num_sequences=count), expected)
    largest_float32_cap = math.floor(math.log(torch.finfo(torch.float32).max))  # 88
    ratio, capped = formulas.unclipped_importance_ratio(torch.tensor([100.0]), largest_float32_cap)
    assert torch.isfinite(ratio).all() and capped.all()


def test_per_row_and_per_token_advantages_give_the_same_loss():
    log_pi, log_mu = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]]), torch.tensor([[-1.5, -2.0], [-0.4, -0.3]])
    per_row = torch.tensor([2.0, -1.0])
    admitted = torch.tensor([True, False])
    assert torch.equal(formulas.reinforce_zero_token_loss(log_pi, log_mu, per_row)[0],
                       formulas.reinforce_zero_token_loss(log_pi, log_mu, per_row[:, None].expand(2, 2))[0])
    assert torch.equal(formulas.flash_reinforce_token_loss(log_pi, log_mu, per_row, admitted)[0],
                       formulas.flash_reinforce_token_loss(log_pi, log_mu, per_row[:, None].expand(2, 2), admitted)[0])


def test_shape_and_scalar_checks_read_no_tensor_data():
    # Meta tensors have a shape and a dtype but no data: a check that read a value (a pass over
    # the tensor, a host synchronisation) would fail here.
    log_pi, log_mu, mask = (torch.empty(4, 6, device="meta") for _ in range(3))
    advantages = torch.empty(4, device="meta")
    token_loss, _ = formulas.reinforce_zero_token_loss(log_pi, log_mu, advantages)
    formulas.sequence_mean_token_mean(token_loss, mask, num_sequences=8)
    admitted, _ = formulas.sequence_trust_region(formulas.sampled_action_bernoulli_kl(log_pi, log_mu), mask, 0.01)
    formulas.flash_reinforce_token_loss(log_pi, log_mu, advantages, admitted)
    with pytest.raises(ValueError, match=r"mask has shape \(4, 1\), but values has \(4, 6\)"):
        formulas.sequence_mean_token_mean(token_loss, mask[:, :1])
