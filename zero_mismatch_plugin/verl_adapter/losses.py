"""verl policy losses ``reinforce_zero`` and ``flash_reinforce``.

verl's ``ppo_loss`` calls them as
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``,
and, with the verl patch 0003 (or a verl that does the same), also with
``rollout_log_probs=`` the rollout engine's own logprob mu (None when the batch has none).

The behaviour logprob mu of every formula (IS ratio pi/mu, FlashREINFORCE's trust-region
KL) is

* ``rollout_log_probs`` when given, whatever ``old_log_prob`` is: in decoupled mode
  ``old_log_prob`` is the trainer's recompute pi_old, and the gap
  log pi - log mu = (log pi - log pi_old) + (log pi_old - log mu) is reported in its two
  parts (``zero_mismatch/recompute_vs_current/*``, ``zero_mismatch/rollout_vs_recompute/*``);
* ``old_log_prob`` otherwise, which is mu only in bypass mode
  (``algorithm.rollout_correction.bypass_mode=true``).

The per-token terms come from :mod:`zero_mismatch_plugin.formulas`; aggregation goes
through verl's ``agg_loss`` with the global batch info, so data parallelism and
micro-batching give the gradient of one big batch.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss

from zero_mismatch_plugin import formulas
from zero_mismatch_plugin.token_metrics import importance_sampling_metrics, log_prob_gap_metrics
from zero_mismatch_plugin.verl_adapter.config import DEFAULT_TRUST_REGION_DELTA
from zero_mismatch_plugin.verl_adapter.estimators import InvalidBatchError

REQUIRED_LOSS_AGG_MODE = "seq-mean-token-mean"


def _check_inputs(algorithm: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                  advantages: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
                  rollout_is_weights: torch.Tensor | None, rollout_log_probs: torch.Tensor | None) -> None:
    if loss_agg_mode != REQUIRED_LOSS_AGG_MODE:
        raise InvalidBatchError(
            f"{algorithm} averages within each response, then over responses: set "
            f"actor_rollout_ref.actor.loss_agg_mode={REQUIRED_LOSS_AGG_MODE} (got {loss_agg_mode})."
        )
    if rollout_is_weights is not None:
        raise InvalidBatchError(_precomputed_weights_message(algorithm, rollout_log_probs is not None))
    _check_shapes(algorithm, old_log_prob, log_prob, advantages, response_mask, rollout_log_probs)
    _check_finite(algorithm, _named_inputs(old_log_prob, log_prob, advantages, rollout_log_probs),
                  response_mask.bool())


def _precomputed_weights_message(algorithm: str, has_rollout_log_probs: bool) -> str:
    message = (f"{algorithm} computes its own unclipped pi/mu, but verl passed precomputed rollout IS weights, "
               "which would correct the same gap twice: set algorithm.rollout_correction.rollout_is=null")
    if has_rollout_log_probs:
        return message + "."
    # Without mu as its own input, old_log_prob must be mu, which only bypass mode gives.
    return (message + " and algorithm.rollout_correction.bypass_mode=true (or pass the rollout's logprobs "
            "to the loss as rollout_log_probs: verl patch 0003).")


def _check_shapes(algorithm: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, rollout_log_probs: torch.Tensor | None) -> None:
    shapes_agree = old_log_prob.shape == log_prob.shape == response_mask.shape == advantages.shape
    if rollout_log_probs is not None:
        shapes_agree = shapes_agree and rollout_log_probs.shape == log_prob.shape
    if not shapes_agree:
        rollout_shape = "" if rollout_log_probs is None else f", rollout_log_probs {tuple(rollout_log_probs.shape)}"
        raise InvalidBatchError(
            f"{algorithm}: shape mismatch old_log_prob {tuple(old_log_prob.shape)}, log_prob "
            f"{tuple(log_prob.shape)}, advantages {tuple(advantages.shape)}, mask {tuple(response_mask.shape)}"
            f"{rollout_shape}; every input must be (batch, response length) with the same padding"
        )


def _named_inputs(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  rollout_log_probs: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    if rollout_log_probs is None:
        return [("rollout logprob (old_log_prob = mu)", old_log_prob), ("trainer logprob", log_prob),
                ("advantages", advantages)]
    return [("rollout logprob (rollout_log_probs = mu)", rollout_log_probs),
            ("trainer recompute (old_log_prob = pi_old)", old_log_prob), ("trainer logprob", log_prob),
            ("advantages", advantages)]


def _check_finite(algorithm: str, named_inputs: list[tuple[str, torch.Tensor]], mask: torch.Tensor) -> None:
    for name, tensor in named_inputs:
        bad = int((~torch.isfinite(tensor.detach()) & mask).sum())
        if bad:
            raise InvalidBatchError(
                f"{algorithm}: {name} is NaN/inf at {bad} response tokens. A sampled token cannot have "
                "probability 0 under the policy that sampled it: check that the trainer applies the same "
                "temperature/top-k/top-p as the rollout and that rollout.calculate_log_probs=true."
            )


def _behaviour_log_prob(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None) -> torch.Tensor:
    """mu: the rollout's own logprob when verl passes it, else old_log_prob (mu in bypass mode)."""
    return old_log_prob if rollout_log_probs is None else rollout_log_probs


def _aggregate(loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, config: Any) -> torch.Tensor:
    global_batch_info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    return agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **global_batch_info)


def _common_metrics(behaviour_log_prob, log_prob, advantages, response_mask) -> dict[str, float]:
    metrics = importance_sampling_metrics(log_prob, behaviour_log_prob, response_mask)
    valid = formulas.valid_rows(response_mask)
    if bool(valid.any()):
        # Rows whose advantage is exactly 0 carry no learning signal (singleton groups,
        # groups where every response got the same reward).
        row_advantage = (advantages.detach() * response_mask).sum(-1)
        metrics["zero_mismatch/zero_advantage_fraction"] = (row_advantage[valid] == 0).float().mean().item()
    return metrics


def _gap_split_metrics(old_log_prob: torch.Tensor, log_prob: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, float]:
    """The gap log pi - log mu in its two parts, each under its own prefix:

    * ``zero_mismatch/rollout_vs_recompute/*``: log pi_old - log mu, the rollout engine against
      the trainer's recompute (kernel mismatch, plus the rollout's weight lag when the
      recompute used newer weights than the ones that sampled);
    * ``zero_mismatch/recompute_vs_current/*``: log pi - log pi_old, the weight change inside
      the trainer (same kernels on both sides).
    """
    parts = {
        "zero_mismatch/rollout_vs_recompute": log_prob_gap_metrics(old_log_prob, rollout_log_probs, response_mask),
        "zero_mismatch/recompute_vs_current": log_prob_gap_metrics(log_prob, old_log_prob, response_mask),
    }
    return {f"{prefix}/{name}": value for prefix, part in parts.items() for name, value in part.items()}


def _loss_metrics(old_log_prob, log_prob, advantages, response_mask, rollout_log_probs) -> dict[str, float]:
    metrics = _common_metrics(_behaviour_log_prob(old_log_prob, rollout_log_probs), log_prob, advantages,
                              response_mask)
    if rollout_log_probs is not None:
        metrics.update(_gap_split_metrics(old_log_prob, log_prob, rollout_log_probs, response_mask))
    return metrics


def reinforce_zero_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = REQUIRED_LOSS_AGG_MODE,
                               config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                               rollout_log_probs: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE Zero: -(1/B) sum_i (1/T_i) sum_t A_i pi/mu, unclipped.

    mu = ``rollout_log_probs`` when given, else ``old_log_prob`` (bypass mode)."""
    _check_inputs("reinforce_zero", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                  rollout_is_weights, rollout_log_probs)
    behaviour_log_prob = _behaviour_log_prob(old_log_prob, rollout_log_probs)
    loss_mat, _ = formulas.reinforce_zero_token_loss(log_prob, behaviour_log_prob, advantages)
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, config)
    return loss, _loss_metrics(old_log_prob, log_prob, advantages, response_mask, rollout_log_probs)


def _trust_region_settings(config: Any) -> tuple[float, str]:
    policy_loss = getattr(config, "policy_loss", None) if config is not None else None
    if policy_loss is None:
        return DEFAULT_TRUST_REGION_DELTA, "behaviour_to_learner"
    return (float(policy_loss.get("trust_region_delta", DEFAULT_TRUST_REGION_DELTA)),
            str(policy_loss.get("kl_direction", "behaviour_to_learner")))


def flash_reinforce_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = REQUIRED_LOSS_AGG_MODE,
                                config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                                rollout_log_probs: torch.Tensor | None = None,
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """FlashREINFORCE: -(1/B) sum_i (m_i A_i / T_i) sum_t pi/mu, m_i = sequence trust-region gate
    on the mean Bernoulli KL between mu and pi.

    mu = ``rollout_log_probs`` when given, else ``old_log_prob`` (bypass mode)."""
    _check_inputs("flash_reinforce", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                  rollout_is_weights, rollout_log_probs)
    behaviour_log_prob = _behaviour_log_prob(old_log_prob, rollout_log_probs)
    delta, direction = _trust_region_settings(config)
    token_kl = formulas.sampled_action_bernoulli_kl(log_prob.detach(), behaviour_log_prob, direction)
    admitted, mean_kl = formulas.sequence_trust_region(token_kl, response_mask, delta)
    loss_mat, _ = formulas.flash_reinforce_token_loss(log_prob, behaviour_log_prob, advantages, admitted)
    # Rejected rows keep their mask, so B (the denominator) still counts them.
    loss = _aggregate(loss_mat, response_mask, loss_agg_mode, config)
    metrics = _loss_metrics(old_log_prob, log_prob, advantages, response_mask, rollout_log_probs)
    valid = formulas.valid_rows(response_mask)
    if bool(valid.any()):
        admitted_fraction = admitted[valid].float().mean().item()
        metrics["flash_reinforce/admitted_fraction"] = admitted_fraction
        metrics["flash_reinforce/seq_kl_mean"] = mean_kl[valid].float().mean().item()
        # Same meaning as verl's sequence rejection-sampling metric.
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = 1.0 - admitted_fraction
    return loss, metrics
