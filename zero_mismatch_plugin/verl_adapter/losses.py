"""verl policy losses ``reinforce_zero`` and ``flash_reinforce``.

verl's ``ppo_loss`` calls them as
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``.
In bypass mode ``old_log_prob`` is the rollout's recorded logprob mu. The per-token terms
come from :mod:`zero_mismatch_plugin.formulas`; aggregation goes through verl's
``agg_loss`` with the global batch info, so data parallelism and micro-batching give the
gradient of one big batch.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss

from zero_mismatch_plugin import formulas
from zero_mismatch_plugin.token_metrics import importance_sampling_metrics
from zero_mismatch_plugin.verl_adapter.config import DEFAULT_TRUST_REGION_DELTA
from zero_mismatch_plugin.verl_adapter.estimators import InvalidBatchError

REQUIRED_LOSS_AGG_MODE = "seq-mean-token-mean"


def _check_inputs(algorithm: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                  advantages: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
                  rollout_is_weights: torch.Tensor | None) -> None:
    if loss_agg_mode != REQUIRED_LOSS_AGG_MODE:
        raise InvalidBatchError(
            f"{algorithm} averages within each response, then over responses: set "
            f"actor_rollout_ref.actor.loss_agg_mode={REQUIRED_LOSS_AGG_MODE} (got {loss_agg_mode})."
        )
    if rollout_is_weights is not None:
        raise InvalidBatchError(
            f"{algorithm} computes its own unclipped pi/mu, but verl passed precomputed rollout IS weights, "
            "so it is in decoupled mode: set algorithm.rollout_correction.bypass_mode=true and "
            "algorithm.rollout_correction.rollout_is=null."
        )
    if not (old_log_prob.shape == log_prob.shape == response_mask.shape == advantages.shape):
        raise InvalidBatchError(
            f"{algorithm}: shape mismatch old_log_prob {tuple(old_log_prob.shape)}, log_prob "
            f"{tuple(log_prob.shape)}, advantages {tuple(advantages.shape)}, mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    for name, tensor in (("rollout logprob (old_log_prob = mu)", old_log_prob), ("trainer logprob", log_prob),
                         ("advantages", advantages)):
        bad = int((~torch.isfinite(tensor.detach()) & mask).sum())
        if bad:
            raise InvalidBatchError(
                f"{algorithm}: {name} is NaN/inf at {bad} response tokens. A sampled token cannot have "
                "probability 0 under the policy that sampled it: check that the trainer applies the same "
                "temperature/top-k/top-p as the rollout and that rollout.calculate_log_probs=true."
            )


def _aggregate(loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, config: Any) -> torch.Tensor:
    global_batch_info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    return agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **global_batch_info)


def _common_metrics(old_log_prob, log_prob, advantages, response_mask) -> dict[str, float]:
    metrics = importance_sampling_metrics(log_prob, old_log_prob, response_mask)
    valid = formulas.valid_rows(response_mask)
    if bool(valid.any()):
        # Rows whose advantage is exactly 0 carry no learning signal (singleton groups,
        # groups where every response got the same reward).
        row_advantage = (advantages.detach() * response_mask).sum(-1)
        metrics["zero_mismatch/zero_advantage_fraction"] = (row_advantage[valid] == 0).float().mean().item()
    return metrics


def reinforce_zero_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = REQUIRED_LOSS_AGG_MODE,
                               config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE Zero: -(1/B) sum_i (1/T_i) sum_t A_i pi/mu, unclipped."""
    _check_inputs("reinforce_zero", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                  rollout_is_weights)
    loss_mat, _ = formulas.reinforce_zero_token_loss(log_prob, old_log_prob, advantages)
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, config)
    return loss, _common_metrics(old_log_prob, log_prob, advantages, response_mask)


def _trust_region_settings(config: Any) -> tuple[float, str]:
    policy_loss = getattr(config, "policy_loss", None) if config is not None else None
    if policy_loss is None:
        return DEFAULT_TRUST_REGION_DELTA, "behaviour_to_learner"
    return (float(policy_loss.get("trust_region_delta", DEFAULT_TRUST_REGION_DELTA)),
            str(policy_loss.get("kl_direction", "behaviour_to_learner")))


def flash_reinforce_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = REQUIRED_LOSS_AGG_MODE,
                                config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """FlashREINFORCE: -(1/B) sum_i (m_i A_i / T_i) sum_t pi/mu, m_i = sequence trust-region gate."""
    _check_inputs("flash_reinforce", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                  rollout_is_weights)
    delta, direction = _trust_region_settings(config)
    token_kl = formulas.sampled_action_bernoulli_kl(log_prob.detach(), old_log_prob, direction)
    admitted, mean_kl = formulas.sequence_trust_region(token_kl, response_mask, delta)
    loss_mat, _ = formulas.flash_reinforce_token_loss(log_prob, old_log_prob, advantages, admitted)
    # Rejected rows keep their mask, so B (the denominator) still counts them.
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, config)
    metrics = _common_metrics(old_log_prob, log_prob, advantages, response_mask)
    valid = formulas.valid_rows(response_mask)
    if bool(valid.any()):
        admitted_fraction = admitted[valid].float().mean().item()
        metrics["flash_reinforce/admitted_fraction"] = admitted_fraction
        metrics["flash_reinforce/seq_kl_mean"] = mean_kl[valid].float().mean().item()
        # Same meaning as verl's sequence rejection-sampling metric.
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = 1.0 - admitted_fraction
    return loss, metrics
