"""Both losses through verl's own ppo_loss (the single worker-side call site), then direct
calls with bad input: padding, 16-bit inputs, empty batches, positive logprobs."""

import math

import pytest
import torch

import verl  # noqa: F401  (loads the plugin through its entry point)
from support.verl_batches import (actor_config, extreme_log_ratio_batch, fill_padding, loss_call, padded_loss_batch,
                          ppo_loss_call, reference_reinforce)

from zero_mismatch_plugin.algorithms import formulas
from zero_mismatch_plugin.integrations.verl import losses
from zero_mismatch_plugin.integrations.verl.estimators import InvalidBatchError

torch.manual_seed(0)
RESPONSE_LENS = [5, 3, 7, 1, 4, 6]
PROMPT_LENS = [3, 2, 4, 2, 3, 5]
ADVANTAGES = [0.7, -0.3, 1.2, -1.0, 0.0, 0.4]
B = len(RESPONSE_LENS)


def _rows(log_ratio_scale: float = 0.3, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    mu = [-torch.rand(n, generator=generator, dtype=torch.float64) * 3 - 0.01 for n in RESPONSE_LENS]
    pi = [m + log_ratio_scale * torch.randn(n, generator=generator, dtype=torch.float64) for m, n in zip(mu, RESPONSE_LENS)]
    pi = [p.clamp(max=-1e-3) for p in pi]
    adv = [torch.full((n,), a, dtype=torch.float64) for n, a in zip(RESPONSE_LENS, ADVANTAGES)]
    return pi, mu, adv


def _grads(loss_mode: str, pi, mu, adv, micro_batches=((0, B),), **policy_fields):
    config = actor_config(loss_mode, **policy_fields)
    leaves = [p.clone().requires_grad_(True) for p in pi]
    total = 0.0
    metrics = None
    for start, stop in micro_batches:
        loss, metrics = ppo_loss_call(config, leaves[start:stop], mu[start:stop], adv[start:stop],
                                      PROMPT_LENS[start:stop], global_batch_size=B)
        loss.backward()
        total += loss.item()
    return total, [leaf.grad for leaf in leaves], metrics


def test_reinforce_zero_gradient_equals_closed_form():
    pi, mu, adv = _rows()
    loss, grads, _ = _grads("reinforce_zero", pi, mu, adv)
    expected_loss = 0.0
    for i in range(B):
        ratio = torch.exp(pi[i] - mu[i])
        # dL/dlog pi_it = -(1/B) A_i rho_it / T_i
        assert torch.allclose(grads[i], -ADVANTAGES[i] * ratio / RESPONSE_LENS[i] / B, rtol=1e-7, atol=0)
        expected_loss += -(ADVANTAGES[i] * ratio).mean().item() / B
    assert loss == pytest.approx(expected_loss, rel=1e-7)


def test_flash_reinforce_gradient_equals_closed_form_with_gate():
    pi, mu, adv = _rows(log_ratio_scale=0.5)
    delta = 0.02
    loss, grads, metrics = _grads("flash_reinforce", pi, mu, adv, trust_region_delta=delta)
    admitted = []
    for i in range(B):
        kl = formulas.bernoulli_kl(mu[i], pi[i]).mean().item()
        admitted.append(kl <= delta)
        ratio = torch.exp(pi[i] - mu[i])
        expected = -ADVANTAGES[i] * ratio / RESPONSE_LENS[i] / B if admitted[-1] else torch.zeros_like(ratio)
        assert torch.allclose(grads[i], expected, rtol=1e-7, atol=0)
    assert 0 < sum(admitted) < B, "the fixture must exercise both admitted and rejected rows"
    assert metrics["flash_reinforce/admitted_fraction"] == pytest.approx(sum(admitted) / B)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 - sum(admitted) / B)


def test_reinforce_zero_matches_verl_bypass_reinforce_with_token_is_and_huge_threshold():
    from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    pi, mu, adv = _rows()
    _, plugin_grads, _ = _grads("reinforce_zero", pi, mu, adv)

    config = actor_config("reinforce_zero")
    rollout_correction = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1e9,
                                                 bypass_mode=True, loss_type="reinforce")
    object.__setattr__(config.policy_loss, "rollout_correction", rollout_correction)
    max_len = max(RESPONSE_LENS)

    def pad(rows):
        return torch.stack([torch.nn.functional.pad(r, (0, max_len - len(r))) for r in rows])

    leaves = [p.clone().requires_grad_(True) for p in pi]
    mask = pad([torch.ones(n, dtype=torch.float64) for n in RESPONSE_LENS]).bool()
    loss, _ = compute_policy_loss_bypass_mode(old_log_prob=pad(mu), log_prob=pad(leaves), advantages=pad(adv),
                                              response_mask=mask, loss_agg_mode="seq-mean-token-mean", config=config)
    loss.backward()
    for plugin_grad, leaf in zip(plugin_grads, leaves):
        assert torch.allclose(plugin_grad, leaf.grad, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_micro_batching_gives_the_gradient_of_one_batch(loss_mode):
    pi, mu, adv = _rows(log_ratio_scale=0.4, seed=3)
    one_loss, one_grads, _ = _grads(loss_mode, pi, mu, adv)
    split_loss, split_grads, _ = _grads(loss_mode, pi, mu, adv, micro_batches=((0, 2), (2, 3), (3, B)))
    assert split_loss == pytest.approx(one_loss, rel=1e-9)
    for a, b in zip(one_grads, split_grads):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-15)


def test_gate_admits_at_delta_exactly_and_rejects_just_below():
    pi, mu, adv = _rows(seed=5)
    pi, mu, adv = pi[:1], mu[:1], adv[:1]
    kl = formulas.bernoulli_kl(mu[0], pi[0]).mean().item()
    config = actor_config("flash_reinforce", trust_region_delta=kl)
    _, metrics = ppo_loss_call(config, pi, mu, adv, PROMPT_LENS[:1], global_batch_size=1)
    assert metrics["flash_reinforce/admitted_fraction"] == 1.0
    below = torch.nextafter(torch.tensor(kl, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)).item()
    config = actor_config("flash_reinforce", trust_region_delta=below)
    _, metrics = ppo_loss_call(config, pi, mu, adv, PROMPT_LENS[:1], global_batch_size=1)
    assert metrics["flash_reinforce/admitted_fraction"] == 0.0


def test_all_rejected_batch_gives_zero_loss_and_finite_gradients():
    pi, mu, adv = _rows()
    mu = [p - 70.0 for p in pi]  # absurd ratios: every row rejected, the log-ratio cap engages
    loss, grads, metrics = _grads("flash_reinforce", pi, mu, adv)
    assert loss == 0.0
    assert all(torch.isfinite(g).all() and not g.any() for g in grads)
    assert metrics["flash_reinforce/admitted_fraction"] == 0.0


def test_metrics_at_pi_equal_mu_are_exact():
    _, mu, adv = _rows()
    _, _, metrics = _grads("reinforce_zero", [m.clone() for m in mu], mu, adv)
    assert metrics["zero_mismatch/bitwise_equal_fraction"] == 1.0
    assert metrics["rollout_corr/rollout_is_mean"] == 1.0
    assert metrics["rollout_corr/k3_kl"] == 0.0
    assert metrics["zero_mismatch/log_prob_abs_diff_max"] == 0.0
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)
    assert metrics["zero_mismatch/zero_advantage_fraction"] == pytest.approx(1 / 6)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["mu", "pi"])
def test_non_finite_logprobs_are_refused(bad_value, which):
    pi, mu, adv = _rows()
    (mu if which == "mu" else pi)[2][1] = bad_value
    with pytest.raises(ValueError, match="NaN/inf at 1 response tokens"):
        _grads("reinforce_zero", pi, mu, adv)


def test_wrong_aggregation_is_refused():
    pi, mu, adv = _rows()
    config = actor_config("reinforce_zero")
    object.__setattr__(config, "loss_agg_mode", "token-mean")
    with pytest.raises(ValueError, match="loss_agg_mode=seq-mean-token-mean"):
        ppo_loss_call(config, pi, mu, adv, PROMPT_LENS, global_batch_size=B)


def test_precomputed_is_weights_mean_decoupled_mode_and_are_refused():
    from zero_mismatch_plugin.integrations.verl.losses import reinforce_zero_policy_loss

    mu = torch.full((2, 3), -1.0)
    with pytest.raises(ValueError, match="bypass_mode=true"):
        reinforce_zero_policy_loss(mu, mu.clone(), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool),
                                   rollout_is_weights=torch.ones(2, 3))


def test_plugin_config_rejects_bad_values():
    # Hydra wraps the config's ValueError when it builds the dataclass from _target_, as verl does.
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="trust_region_delta must be a positive number"):
        actor_config("flash_reinforce", trust_region_delta=0.0)
    with pytest.raises(InstantiationException, match="kl_direction must be one of"):
        actor_config("flash_reinforce", kl_direction="forward")


# ----- bad input: padding, low precision, empty batches, positive logprobs --------------------

POISONS = [float("nan"), float("inf"), float("-inf"), 3e38, -3e38]
# (tensor poisoned, whether mu is passed as rollout_log_probs)
POISONED_INPUTS = [("log_prob", False), ("old_log_prob", False), ("advantages", False),
                   ("rollout_log_probs", True), ("old_log_prob", True)]


def _padded_call(loss_mode, pi, mu, old, advantages, mask, with_rollout_log_probs, poisoned=None, poison=0.0):
    inputs = {"log_prob": pi, "old_log_prob": old if with_rollout_log_probs else mu, "advantages": advantages}
    if with_rollout_log_probs:
        inputs["rollout_log_probs"] = mu
    if poisoned is not None:
        inputs[poisoned] = fill_padding(inputs[poisoned], mask, poison)
    keywords = {"rollout_log_probs": inputs["rollout_log_probs"]} if with_rollout_log_probs else {}
    return loss_call(loss_mode, inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"], mask, **keywords)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("poisoned,with_rollout_log_probs", POISONED_INPUTS)
@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_whatever_padding_holds_loss_gradient_and_metrics_are_bit_identical(loss_mode, poisoned,
                                                                           with_rollout_log_probs, poison):
    pi, mu, old, advantages, mask = padded_loss_batch()
    clean = _padded_call(loss_mode, pi, mu, old, advantages, mask, with_rollout_log_probs)
    dirty = _padded_call(loss_mode, pi, mu, old, advantages, mask, with_rollout_log_probs, poisoned, poison)
    assert torch.equal(dirty[0], clean[0])
    assert torch.equal(dirty[1], clean[1])
    assert dirty[2] == clean[2]
    assert not clean[1][~mask].any()
    if loss_mode == "flash_reinforce":  # the fixture has rows on both sides of the gate
        assert 0.0 < clean[2]["flash_reinforce/admitted_fraction"] < 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_16_bit_inputs_are_computed_in_fp32_and_match_an_fp64_reference(loss_mode, dtype):
    pi, mu, advantages, mask = extreme_log_ratio_batch(dtype)
    assert bool(((pi - mu).float()[mask] > 11.1).any()), "the fixture must hold ratios beyond the fp16 range"
    # A delta no row exceeds: FlashREINFORCE then trains on every row, like REINFORCE Zero.
    config = actor_config(loss_mode, trust_region_delta=1e9) if loss_mode == "flash_reinforce" else None
    loss, grad, metrics = loss_call(loss_mode, pi, mu, advantages, mask, config=config)
    reference_loss, reference_grad, capped_fraction = reference_reinforce(pi, mu, advantages, mask,
                                                                          formulas.log_ratio_cap(dtype))
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.isfinite(grad).all()
    assert loss.item() == pytest.approx(reference_loss, rel=1e-6)
    assert torch.allclose(grad.double(), reference_grad.to(dtype).double(), rtol=torch.finfo(dtype).eps, atol=0)
    assert capped_fraction > 0
    assert metrics["zero_mismatch/is_log_ratio_capped_fraction"] == pytest.approx(capped_fraction)
    assert all(math.isfinite(value) for value in metrics.values())


def test_fp16_cap_keeps_the_largest_ratio_inside_fp16():
    cap = formulas.log_ratio_cap(torch.float16)
    assert math.exp(cap) <= torch.finfo(torch.float16).max < math.exp(cap + 1)
    assert formulas.log_ratio_cap(torch.float32) == formulas.log_ratio_cap(torch.bfloat16) == 50.0


def _empty_batches():
    pi, mu, _, advantages, mask = padded_loss_batch()
    return {
        "no rows": (pi[:0], mu[:0], advantages[:0], mask[:0]),
        "no tokens": (pi[:, :0], mu[:, :0], advantages[:, :0], mask[:, :0]),
        "every row masked": (pi, mu, advantages, torch.zeros_like(mask)),
    }


@pytest.mark.parametrize("empty", ["no rows", "no tokens", "every row masked"])
@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_a_batch_without_response_tokens_gives_loss_0_and_zero_gradients(loss_mode, empty):
    pi, mu, advantages, mask = _empty_batches()[empty]
    loss, grad, metrics = loss_call(loss_mode, pi, mu, advantages, mask)
    assert loss.item() == 0.0
    assert grad is not None and grad.shape == pi.shape and not grad.any()
    assert metrics == {}  # every metric describes response tokens; there are none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("positive_in", ["log_prob", "old_log_prob", "rollout_log_probs"])
@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_positive_log_probs_beyond_rounding_are_refused(loss_mode, positive_in, dtype):
    pi, mu, old, advantages, mask = padded_loss_batch(dtype=dtype)
    tolerance = losses.positive_log_prob_tolerance(dtype)
    inputs = {"log_prob": pi, "old_log_prob": old, "rollout_log_probs": mu}

    def call_with(value):
        changed = dict(inputs)
        changed[positive_in] = inputs[positive_in].clone()
        changed[positive_in][2, 3] = value
        return loss_call(loss_mode, changed["log_prob"], changed["old_log_prob"], advantages, mask,
                         rollout_log_probs=changed["rollout_log_probs"])

    loss, _, _ = call_with(tolerance)  # at the tolerance: rounding, accepted
    assert torch.isfinite(loss)
    just_above = tolerance * (1 + torch.finfo(dtype).eps)  # the next value of the dtype
    assert torch.tensor(just_above, dtype=dtype).item() > tolerance
    with pytest.raises(InvalidBatchError, match=rf"\({positive_in}[ )=].* is positive at 1 response tokens"):
        call_with(just_above)


def test_rounding_tolerance_of_positive_log_probs_per_dtype():
    assert losses.positive_log_prob_tolerance(torch.float32) == 2.0**-13
    assert losses.positive_log_prob_tolerance(torch.float64) == 2.0**-13
    assert losses.positive_log_prob_tolerance(torch.bfloat16) == 2.0**-5
    assert losses.positive_log_prob_tolerance(torch.float16) == 2.0**-8


@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_a_loss_that_overflows_is_refused(loss_mode):
    pi, mu, _, advantages, mask = padded_loss_batch()
    config = actor_config(loss_mode, trust_region_delta=1e9) if loss_mode == "flash_reinforce" else None
    huge = torch.where(mask, torch.tensor(3e38), 0.0)  # a row of 5 tokens sums past the fp32 range
    with pytest.raises(InvalidBatchError, match="loss overflowed torch.float32 .* scale the rewards down"):
        loss_call(loss_mode, pi, mu, huge, mask, config=config)


@pytest.mark.parametrize("mask_value", [0.5, 2.0, -1.0, float("nan")])
def test_masks_other_than_0_and_1_are_refused(mask_value):
    pi, mu, _, advantages, mask = padded_loss_batch()
    numeric = mask.float()
    numeric[1, 0] = mask_value
    with pytest.raises(InvalidBatchError, match="response_mask must hold only 0 and 1"):
        loss_call("reinforce_zero", pi, mu, advantages, numeric)


@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_a_0_1_mask_of_any_dtype_trains_like_the_bool_mask(loss_mode):
    pi, mu, _, advantages, mask = padded_loss_batch()
    expected = loss_call(loss_mode, pi, mu, advantages, mask)
    for dtype in (torch.float32, torch.int64, torch.uint8):
        got = loss_call(loss_mode, pi, mu, advantages, mask.to(dtype))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]


@pytest.mark.parametrize("loss_mode", ["reinforce_zero", "flash_reinforce"])
def test_global_batch_info_must_hold_finite_whole_counts(loss_mode):
    pi, mu, _, advantages, mask = padded_loss_batch()

    def call(**info):
        fields = {"trust_region_delta": 1e9} if loss_mode == "flash_reinforce" else {}
        config = actor_config(loss_mode, **fields)
        config.global_batch_info.update(info)
        return loss_call(loss_mode, pi, mu, advantages, mask, config=config)

    whole = call(dp_size=2, global_batch_size=8)
    as_floats = call(dp_size=2.0, global_batch_size=8.0)
    assert torch.equal(whole[0], as_floats[0]) and torch.equal(whole[1], as_floats[1])
    # an infinite count would give loss 0, a fractional one rescale every gradient
    for size in (math.inf, 7.5):
        with pytest.raises(InvalidBatchError, match="global_batch_size .* is not a count"):
            call(dp_size=1, global_batch_size=size)
    for dp_size in (1.5, math.inf):
        with pytest.raises(InvalidBatchError, match="dp_size .* must be a number >= 1"):
            call(dp_size=dp_size, global_batch_size=8)
