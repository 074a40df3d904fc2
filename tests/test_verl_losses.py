"""Both losses through verl's own ppo_loss (the single worker-side call site)."""

import pytest
import torch

import verl  # noqa: F401  (loads the plugin through its entry point)
from verl_batches import actor_config, ppo_loss_call

from zero_mismatch_plugin import formulas

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
    pi = [m + 70.0 for m in mu]  # absurd ratios: every row rejected, the log-ratio cap engages
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
    from zero_mismatch_plugin.verl_adapter.losses import reinforce_zero_policy_loss

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
