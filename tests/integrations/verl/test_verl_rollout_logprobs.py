"""Both losses with the rollout's own logprob mu as the ``rollout_log_probs`` input.

In decoupled mode verl's ``old_log_prob`` is the trainer's recompute pi_old; with mu passed
separately the losses must train exactly as in bypass mode (old_log_prob = mu) and report
the gap in its two parts. Direct calls first, then through verl's ``ppo_loss`` with the verl
patches applied (and, for contrast, stock verl, which never passes mu).
"""

from __future__ import annotations

import math

import pytest
import torch

import verl  # noqa: F401  (loads the plugin through its entry point)
from support.verl_batches import actor_config

from zero_mismatch_plugin.algorithms import formulas

from zero_mismatch_plugin import fork_patches
from zero_mismatch_plugin.integrations.verl.call_guards import accepts_keyword
from zero_mismatch_plugin.integrations.verl.estimators import InvalidBatchError
from zero_mismatch_plugin.integrations.verl.losses import flash_reinforce_policy_loss, reinforce_zero_policy_loss

from support.preloaded_python import run_script

LOSSES = {"reinforce_zero": reinforce_zero_policy_loss, "flash_reinforce": flash_reinforce_policy_loss}
RESPONSE_LENS = [5, 3, 7, 1, 4, 6]
ADVANTAGES = [0.7, -0.3, 1.2, -1.0, 0.5, 0.4]
SPLIT_PREFIXES = ("zero_mismatch/rollout_vs_recompute/", "zero_mismatch/recompute_vs_current/")


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


def _three_policy_batch(seed: int = 0):
    """mu (rollout), pi_old = mu + mismatch and lag (the trainer's recompute), pi = pi_old + an update."""
    generator = torch.Generator().manual_seed(seed)
    mu = [-torch.rand(n, generator=generator) * 3 - 0.01 for n in RESPONSE_LENS]
    old = [(m + 0.3 * torch.randn(n, generator=generator)).clamp(max=-1e-3) for m, n in zip(mu, RESPONSE_LENS)]
    pi = [(o + 0.2 * torch.randn(n, generator=generator)).clamp(max=-1e-3) for o, n in zip(old, RESPONSE_LENS)]
    advantages = [torch.full((n,), a) for n, a in zip(RESPONSE_LENS, ADVANTAGES)]
    mask = _padded([torch.ones(n, dtype=torch.bool) for n in RESPONSE_LENS])
    return _padded(pi), _padded(old), _padded(mu), _padded(advantages), mask


def _split_delta(pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> float:
    """A trust-region delta between the rows' mean Bernoulli KLs to mu: the gate admits some, rejects others."""
    token_kl = formulas.sampled_action_bernoulli_kl(pi, mu)
    _, mean_kl = formulas.sequence_trust_region(token_kl, mask, 0.0)
    return mean_kl.sort().values[len(RESPONSE_LENS) // 2].item()


def _call(loss_mode: str, config, pi, old, advantages, mask, **keywords):
    leaf = pi.clone().requires_grad_(True)
    loss, metrics = LOSSES[loss_mode](old_log_prob=old, log_prob=leaf, advantages=advantages, response_mask=mask,
                                      loss_agg_mode="seq-mean-token-mean", config=config, rollout_is_weights=None,
                                      **keywords)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def _config(loss_mode: str, pi, mu, mask):
    if loss_mode == "flash_reinforce":
        return actor_config(loss_mode, trust_region_delta=_split_delta(pi, mu, mask))
    return actor_config(loss_mode)


# ----- direct calls -------------------------------------------------------------------------


@pytest.mark.parametrize("loss_mode", sorted(LOSSES))
def test_registered_losses_take_the_keyword_the_patched_ppo_loss_passes(loss_mode):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    assert accepts_keyword(get_policy_loss_fn(loss_mode), "rollout_log_probs")


@pytest.mark.parametrize("loss_mode", sorted(LOSSES))
def test_rollout_log_probs_give_the_bypass_mode_loss_and_gradient_bit_for_bit(loss_mode):
    pi, old, mu, advantages, mask = _three_policy_batch()
    config = _config(loss_mode, pi, mu, mask)
    loss, grad, metrics = _call(loss_mode, config, pi, old, advantages, mask, rollout_log_probs=mu)
    bypass_loss, bypass_grad, bypass_metrics = _call(loss_mode, config, pi, mu, advantages, mask)
    assert torch.equal(loss, bypass_loss)
    assert torch.equal(grad, bypass_grad)
    # Every metric of bypass mode (all computed against mu) is unchanged.
    assert {key: metrics[key] for key in bypass_metrics} == bypass_metrics
    # The fixture matters: training against pi_old would give another loss and gradient.
    recompute_loss, recompute_grad, _ = _call(loss_mode, config, pi, old, advantages, mask)
    assert not torch.equal(loss, recompute_loss) and not torch.equal(grad, recompute_grad)
    if loss_mode == "flash_reinforce":
        assert 0.0 < metrics["flash_reinforce/admitted_fraction"] < 1.0


@pytest.mark.parametrize("loss_mode", sorted(LOSSES))
def test_none_keeps_old_log_prob_as_mu_and_adds_no_split_metrics(loss_mode):
    pi, old, mu, advantages, mask = _three_policy_batch(seed=1)
    config = _config(loss_mode, pi, old, mask)
    loss, grad, metrics = _call(loss_mode, config, pi, old, advantages, mask, rollout_log_probs=None)
    omitted_loss, omitted_grad, omitted_metrics = _call(loss_mode, config, pi, old, advantages, mask)
    assert torch.equal(loss, omitted_loss) and torch.equal(grad, omitted_grad)
    assert metrics == omitted_metrics
    assert not any(key.startswith(SPLIT_PREFIXES) for key in metrics)
    if loss_mode == "reinforce_zero":
        # old_log_prob is mu: the closed form -(1/B) sum_i (1/T_i) sum_t A_i pi/old.
        row_means = ((-advantages * torch.exp(pi - old)) * mask).sum(-1) / mask.sum(-1)
        assert loss.item() == pytest.approx(row_means.mean().item(), rel=1e-6)


def _hand_built_batch():
    """Two responses, 4 + 2 tokens, dyadic logprobs so every difference is exact in fp32.

    pi_old - mu  = [0, 0.5, 0, -0.25 | 0, 0.125]  (half the tokens differ)
    pi - pi_old  = [0.25, 0, 0, 0    | 0, 0    ]  (one token differs)
    """
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    mu = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-1.0, -0.25, 0.0, 0.0]])
    rollout_vs_recompute = torch.tensor([[0.0, 0.5, 0.0, -0.25], [0.0, 0.125, 0.0, 0.0]])
    recompute_vs_current = torch.tensor([[0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = mu + rollout_vs_recompute
    pi = old + recompute_vs_current
    advantages = torch.tensor([[1.0] * 4, [-1.0] * 4]) * mask
    return pi, old, mu, advantages, mask


def _k3(*log_ratios: float) -> float:
    """Mean of w - 1 - log w over the 6 response tokens (the unlisted ones have log w = 0)."""
    return sum(math.expm1(d) - d for d in log_ratios) / 6


@pytest.mark.parametrize("loss_mode", sorted(LOSSES))
def test_split_metrics_on_a_hand_built_batch(loss_mode):
    pi, old, mu, advantages, mask = _hand_built_batch()
    _, _, metrics = _call(loss_mode, actor_config(loss_mode), pi, old, advantages, mask, rollout_log_probs=mu)

    assert metrics["zero_mismatch/rollout_vs_recompute/bitwise_equal_fraction"] == 0.5
    assert metrics["zero_mismatch/rollout_vs_recompute/log_prob_abs_diff_max"] == 0.5
    assert metrics["zero_mismatch/rollout_vs_recompute/kl"] == -0.0625  # -(0.5 - 0.25 + 0.125) / 6
    assert metrics["zero_mismatch/rollout_vs_recompute/k3_kl"] == pytest.approx(_k3(0.5, -0.25, 0.125), rel=1e-6)

    assert metrics["zero_mismatch/recompute_vs_current/bitwise_equal_fraction"] == pytest.approx(5 / 6, rel=1e-7)
    assert metrics["zero_mismatch/recompute_vs_current/log_prob_abs_diff_max"] == 0.25
    assert metrics["zero_mismatch/recompute_vs_current/kl"] == pytest.approx(-0.25 / 6, rel=1e-7)
    assert metrics["zero_mismatch/recompute_vs_current/k3_kl"] == pytest.approx(_k3(0.25), rel=1e-6)

    # The whole gap stays against mu: 4 of 6 tokens differ, and k1 KLs of the parts add up.
    assert metrics["zero_mismatch/bitwise_equal_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/kl"] == pytest.approx(
        metrics["zero_mismatch/rollout_vs_recompute/kl"] + metrics["zero_mismatch/recompute_vs_current/kl"], rel=1e-6)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(_k3(0.25, 0.5, -0.25, 0.125), rel=1e-6)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("loss_mode", sorted(LOSSES))
def test_non_finite_rollout_log_probs_are_refused(loss_mode, bad_value):
    pi, old, mu, advantages, mask = _hand_built_batch()
    mu[1, 1] = bad_value
    with pytest.raises(InvalidBatchError, match=r"rollout_log_probs = mu\) is NaN/inf at 1 response tokens"):
        _call(loss_mode, actor_config(loss_mode), pi, old, advantages, mask, rollout_log_probs=mu)


def test_non_finite_recompute_is_refused_when_mu_is_given():
    pi, old, mu, advantages, mask = _hand_built_batch()
    old[0, 2] = float("nan")
    with pytest.raises(InvalidBatchError, match=r"old_log_prob = pi_old\) is NaN/inf at 1 response tokens"):
        _call("reinforce_zero", actor_config("reinforce_zero"), pi, old, advantages, mask, rollout_log_probs=mu)


@pytest.mark.parametrize("loss_mode", sorted(LOSSES))
def test_rollout_log_probs_of_another_shape_are_refused(loss_mode):
    pi, old, mu, advantages, mask = _hand_built_batch()
    with pytest.raises(InvalidBatchError, match=r"shape mismatch .* rollout_log_probs \(2, 3\)"):
        _call(loss_mode, actor_config(loss_mode), pi, old, advantages, mask, rollout_log_probs=mu[:, :3])


def test_precomputed_is_weights_are_refused_next_to_rollout_log_probs():
    pi, old, mu, advantages, mask = _hand_built_batch()
    with pytest.raises(InvalidBatchError, match="twice: set algorithm.rollout_correction.rollout_is=null.") as refused:
        reinforce_zero_policy_loss(old, pi, advantages, mask, rollout_is_weights=torch.ones_like(mu),
                                   rollout_log_probs=mu)
    # With mu as its own input, bypass mode is not what is missing.
    assert "bypass_mode" not in str(refused.value)


# ----- through verl's ppo_loss ----------------------------------------------------------------


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory):
    """A full copy of the installed verl with every verl patch applied."""
    return fork_patches.copy_patched_package(fork_patches.load_manifest(), "verl", tmp_path_factory.mktemp("patched-verl"))


# One batch through verl's ppo_loss in decoupled mode (rollout_is null, bypass off): old_log_probs
# is the trainer's recompute pi_old, rollout_log_probs the engine's mu.
PPO_LOSS_SETUP = """
    import torch
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.utils import losses
    from support.verl_batches import actor_config, ppo_loss_call
    from zero_mismatch_plugin.algorithms import formulas
    from zero_mismatch_plugin.algorithms.token_metrics import log_prob_gap_metrics

    generator = torch.Generator().manual_seed(7)
    lens, prompt_lens = [5, 3, 6, 4, 2, 7], [2, 3, 2, 4, 3, 2]
    mu = [-torch.rand(n, generator=generator) * 3 - 0.01 for n in lens]
    old = [(m + 0.3 * torch.randn(n, generator=generator)).clamp(max=-1e-3) for m, n in zip(mu, lens)]
    pi = [(o + 0.2 * torch.randn(n, generator=generator)).clamp(max=-1e-3) for o, n in zip(old, lens)]
    adv = [torch.full((n,), a) for n, a in zip(lens, [0.7, -0.3, 1.2, -1.0, 0.5, 0.4])]

    def padded(rows):
        return torch.stack([torch.nn.functional.pad(r, (0, max(lens) - len(r))) for r in rows])

    mask = padded([torch.ones(n) for n in lens]).bool()
    _, row_kl = formulas.sequence_trust_region(formulas.sampled_action_bernoulli_kl(padded(pi), padded(mu)), mask, 0.0)
    # Between the rows' mean KLs to mu: FlashREINFORCE's gate admits some rows and rejects others.
    delta = row_kl.sort().values[len(lens) // 2].item()

    def call(loss_mode, old_rows, mu_rows, bypass):
        fields = {"trust_region_delta": delta} if loss_mode == "flash_reinforce" else {}
        config = actor_config(loss_mode, **fields)
        object.__setattr__(config.policy_loss, "rollout_correction",
                           RolloutCorrectionConfig(rollout_is=None, bypass_mode=bypass))
        leaves = [p.clone().requires_grad_(True) for p in pi]
        loss, metrics = ppo_loss_call(config, leaves, old_rows, adv, prompt_lens, global_batch_size=len(lens),
                                      rollout_log_prob_rows=mu_rows)
        loss.backward()
        return loss.detach(), [leaf.grad for leaf in leaves], metrics

    def same(a, b):
        return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    SPLIT = ("zero_mismatch/rollout_vs_recompute/", "zero_mismatch/recompute_vs_current/")
"""

PATCHED_PPO_LOSS_CHECKS = """
    assert losses.__file__.startswith(PATCHED_ROOT), losses.__file__
    from zero_mismatch_plugin.integrations.verl import verl_passes_rollout_log_probs
    assert verl_passes_rollout_log_probs()  # so the estimators and validate-config allow bypass off
    expected_split = {}
    for prefix, current, reference in (("zero_mismatch/rollout_vs_recompute/", old, mu),
                                       ("zero_mismatch/recompute_vs_current/", pi, old)):
        for name, value in log_prob_gap_metrics(padded(current), padded(reference), mask).items():
            expected_split[prefix + name] = value
    for loss_mode in ("reinforce_zero", "flash_reinforce"):
        decoupled = call(loss_mode, old, mu, bypass=False)
        bypass = call(loss_mode, mu, None, bypass=True)
        assert same(decoupled, bypass), loss_mode
        assert not same(decoupled, call(loss_mode, old, None, bypass=False)), loss_mode
        metrics = decoupled[2]
        assert all(metrics[key] == value for key, value in bypass[2].items()), (loss_mode, metrics, bypass[2])
        split = {key: value for key, value in metrics.items() if key.startswith(SPLIT)}
        assert split == expected_split, (loss_mode, split, expected_split)
        assert split["zero_mismatch/rollout_vs_recompute/bitwise_equal_fraction"] == 0.0
        if loss_mode == "flash_reinforce":
            assert 0.0 < metrics["flash_reinforce/admitted_fraction"] < 1.0, metrics
        print(loss_mode, "DECOUPLED USES MU", flush=True)
    print("PATCHED OK")
"""

STOCK_PPO_LOSS_CHECKS = """
    from zero_mismatch_plugin.integrations.verl import verl_passes_rollout_log_probs
    assert not verl_passes_rollout_log_probs()  # the estimators keep requiring bypass mode
    for loss_mode in ("reinforce_zero", "flash_reinforce"):
        decoupled = call(loss_mode, old, mu, bypass=False)
        # Stock verl drops rollout_log_probs: the loss takes old_log_prob (pi_old) for mu, as it always has.
        assert same(decoupled, call(loss_mode, old, None, bypass=False)), loss_mode
        assert not same(decoupled, call(loss_mode, mu, None, bypass=True)), loss_mode
        assert not any(key.startswith(SPLIT) for key in decoupled[2]), decoupled[2]
        print(loss_mode, "STOCK USES OLD_LOG_PROB", flush=True)
    print("STOCK OK")
"""


def test_patched_verl_decoupled_mode_trains_on_mu_and_reports_the_split(patched_verl):
    script = PPO_LOSS_SETUP + PATCHED_PPO_LOSS_CHECKS.replace("PATCHED_ROOT", repr(str(patched_verl)))
    result = run_script(script, patched_verl)
    assert result.returncode == 0 and "PATCHED OK" in result.stdout, result.stdout + result.stderr[-6000:]


def test_stock_verl_decoupled_mode_still_trains_on_old_log_prob():
    result = run_script(PPO_LOSS_SETUP + STOCK_PPO_LOSS_CHECKS)
    assert result.returncode == 0 and "STOCK OK" in result.stdout, result.stdout + result.stderr[-6000:]
