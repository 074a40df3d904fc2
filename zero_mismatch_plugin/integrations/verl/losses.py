"""verl policy losses ``reinforce_zero`` and ``flash_reinforce``.

Called by verl's ``ppo_loss``, with ``rollout_log_probs=`` (the engine's own μ) where verl passes
it; μ is that input when given, else ``old_log_prob`` (μ only in bypass mode). Per-token terms come
from :mod:`zero_mismatch_plugin.algorithms.formulas`, aggregation through verl's ``agg_loss``;
masked positions are never read. See docs/algorithms.md ("rollout_log_probs", "Bad input: the losses").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss

from zero_mismatch_plugin.algorithms import formulas
from zero_mismatch_plugin.algorithms.token_metrics import importance_sampling_metrics, log_prob_gap_metrics
from zero_mismatch_plugin.integrations.verl.config import DEFAULT_TRUST_REGION_DELTA, KL_DIRECTIONS
from zero_mismatch_plugin.integrations.verl.estimators import InvalidBatchError, bool_response_mask

REQUIRED_LOSS_AGG_MODE = "seq-mean-token-mean"

# A log-probability is <= 0, but a log-softmax whose logit and log-sum-exp are computed
# apart (fused or tensor-parallel kernels, a temperature applied twice) can round a
# near-certain token a few units above 0. Up to 2^-13 (1.2e-4; fp32 and fp64), or 4 eps
# for 16-bit formats (bf16 2^-5, fp16 2^-8), is rounding; anything above is refused.
POSITIVE_LOG_PROB_TOLERANCE_FLOOR = 2.0**-13


def positive_log_prob_tolerance(dtype: torch.dtype) -> float:
    """The largest log-probability of ``dtype`` accepted as rounding of a value <= 0."""
    return max(POSITIVE_LOG_PROB_TOLERANCE_FLOOR, 4 * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class _Batch:
    """The loss inputs after checking, with every masked position replaced by 0, so that
    nothing padding holds reaches the loss, its gradient or a metric."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor  # bool
    rollout_log_probs: torch.Tensor | None

    @property
    def behaviour_log_prob(self) -> torch.Tensor:
        """mu: the rollout's own logprob when verl passes it, else old_log_prob (mu in bypass mode)."""
        return self.old_log_prob if self.rollout_log_probs is None else self.rollout_log_probs


def _checked_batch(algorithm: str, old_log_prob: Any, log_prob: Any, advantages: Any, response_mask: Any,
                   loss_agg_mode: str, rollout_is_weights: Any, rollout_log_probs: Any) -> _Batch:
    if loss_agg_mode != REQUIRED_LOSS_AGG_MODE:
        raise InvalidBatchError(
            f"{algorithm} averages within each response, then over responses: set "
            f"actor_rollout_ref.actor.loss_agg_mode={REQUIRED_LOSS_AGG_MODE} (got {loss_agg_mode})."
        )
    if rollout_is_weights is not None:
        raise InvalidBatchError(_precomputed_weights_message(algorithm, rollout_log_probs is not None))
    named_log_probs = _named_log_probs(old_log_prob, log_prob, rollout_log_probs)
    for name, tensor in [*named_log_probs, ("advantages", advantages)]:
        _check_floating_tensor(algorithm, name, tensor)
    mask = bool_response_mask(algorithm, response_mask)
    _check_shapes(algorithm, old_log_prob, log_prob, advantages, mask, rollout_log_probs)
    clean_old, clean_current, *clean_rollout = [
        _checked_log_prob(algorithm, name, formulas.masked(tensor, mask)) for name, tensor in named_log_probs]
    clean_advantages = formulas.masked(advantages, mask)
    if not _all_within(clean_advantages, math.inf):
        raise InvalidBatchError(_non_finite_message(algorithm, "advantages", clean_advantages))
    return _Batch(clean_old, clean_current, clean_advantages, mask, clean_rollout[0] if clean_rollout else None)


def _precomputed_weights_message(algorithm: str, has_rollout_log_probs: bool) -> str:
    message = (f"{algorithm} computes its own unclipped pi/mu, but verl passed precomputed rollout IS weights, "
               "which would correct the same gap twice: set algorithm.rollout_correction.rollout_is=null")
    if has_rollout_log_probs:
        return message + "."
    # Without mu as its own input, old_log_prob must be mu, which only bypass mode gives.
    return (message + " and algorithm.rollout_correction.bypass_mode=true (or pass the rollout's logprobs "
            "to the loss as rollout_log_probs: verl patch 0003).")


def _named_log_probs(old_log_prob: Any, log_prob: Any, rollout_log_probs: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of every logprob input, in the order old_log_prob, log_prob, rollout_log_probs."""
    if rollout_log_probs is None:
        return [("rollout logprob (old_log_prob = mu)", old_log_prob), ("trainer logprob (log_prob)", log_prob)]
    return [("trainer recompute (old_log_prob = pi_old)", old_log_prob), ("trainer logprob (log_prob)", log_prob),
            ("rollout logprob (rollout_log_probs = mu)", rollout_log_probs)]


def _check_floating_tensor(algorithm: str, name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise InvalidBatchError(f"{algorithm}: {name} must be a torch.Tensor of shape (batch, response length), "
                                f"got {type(value).__name__}.")
    if not value.is_floating_point():
        raise InvalidBatchError(f"{algorithm}: {name} must be a floating-point tensor, got {value.dtype}: "
                                "pass log-probabilities and advantages as float32 (or bfloat16/float16/float64).")


def _check_shapes(algorithm: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, rollout_log_probs: torch.Tensor | None) -> None:
    shapes_agree = old_log_prob.shape == log_prob.shape == response_mask.shape == advantages.shape
    if rollout_log_probs is not None:
        shapes_agree = shapes_agree and rollout_log_probs.shape == log_prob.shape
    if not shapes_agree or log_prob.dim() != 2:
        rollout_shape = "" if rollout_log_probs is None else f", rollout_log_probs {tuple(rollout_log_probs.shape)}"
        raise InvalidBatchError(
            f"{algorithm}: shape mismatch old_log_prob {tuple(old_log_prob.shape)}, log_prob "
            f"{tuple(log_prob.shape)}, advantages {tuple(advantages.shape)}, mask {tuple(response_mask.shape)}"
            f"{rollout_shape}; every input must be (batch, response length) with the same padding"
        )


def _checked_log_prob(algorithm: str, name: str, clean: torch.Tensor) -> torch.Tensor:
    """Refuse NaN/inf and log-probabilities above the rounding tolerance at response tokens.
    ``clean`` holds 0 at every masked position."""
    tolerance = positive_log_prob_tolerance(clean.dtype)
    if _all_within(clean, tolerance):
        return clean
    if not bool(torch.isfinite(clean).all()):
        raise InvalidBatchError(_non_finite_message(algorithm, name, clean))
    positive = clean.detach() > tolerance
    raise InvalidBatchError(
        f"{algorithm}: {name} is positive at {int(positive.sum())} response tokens (max "
        f"{clean.detach().max().item():.4g}, above the rounding tolerance {tolerance:.3g} of {clean.dtype}); a "
        "log-probability is <= 0: check that this input holds the log-probability of each sampled token, "
        "not a logit or a negative log-likelihood."
    )


def _all_within(clean: torch.Tensor, upper: float) -> bool:
    """Every value is > -inf and <= ``upper`` (< inf when ``upper`` is inf); NaN fails. One
    pass: min and max propagate NaN."""
    if clean.numel() == 0:
        return True
    lowest, highest = torch.aminmax(clean.detach())
    within = (lowest > -math.inf) & (highest < math.inf if upper == math.inf else highest <= upper)
    return bool(within)


def _non_finite_message(algorithm: str, name: str, clean: torch.Tensor) -> str:
    bad = int((~torch.isfinite(clean.detach())).sum())
    if name == "advantages":
        return (f"{algorithm}: advantages are NaN/inf at {bad} response tokens: check the reward function "
                "and the advantage estimator.")
    return (f"{algorithm}: {name} is NaN/inf at {bad} response tokens. A sampled token cannot have "
            "probability 0 under the policy that sampled it: check that the trainer applies the same "
            "temperature/top-k/top-p as the rollout and that rollout.calculate_log_probs=true.")


def _aggregate(loss_mat: torch.Tensor, batch: _Batch, loss_agg_mode: str, config: Any, algorithm: str
               ) -> torch.Tensor:
    """verl's aggregation with the global batch info (one big batch across data parallelism and
    micro-batches). A micro-batch without any response token (B = 0, T = 0, every row
    masked) gives a loss of exactly 0 whose gradient is 0, still connected to log_prob."""
    if not bool(batch.mask.any()):
        return batch.log_prob.to(loss_mat.dtype).sum() * 0.0  # log_prob is 0 at every masked position
    global_batch_info = _global_batch_info(config, algorithm, int(formulas.valid_rows(batch.mask).sum()))
    loss = agg_loss(loss_mat=loss_mat, loss_mask=batch.mask, loss_agg_mode=loss_agg_mode, **global_batch_info)
    if not bool(torch.isfinite(loss)):
        raise InvalidBatchError(
            f"{algorithm}: the loss overflowed {loss_mat.dtype} (advantage x IS ratio; largest |advantage| "
            f"{batch.advantages.abs().max().item():.3g}): scale the rewards down so that advantages stay well "
            "inside the float range."
        )
    return loss


def _global_batch_info(config: Any, algorithm: str, responses: int) -> dict[str, Any]:
    """verl's global batch info (set by its ppo_loss), checked: the mini-batch that
    ``global_batch_size`` counts holds at least this micro-batch's responses, and both it and
    ``dp_size`` are finite whole numbers, else every gradient would be scaled (to 0 by an
    infinite count, by 1.5 by a dp_size of 1.5) without a word."""
    info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    size, dp_size = info.get("global_batch_size"), info.get("dp_size", 1)
    if size is not None and not (_is_count(size) and size >= responses):  # NaN fails too
        raise InvalidBatchError(
            f"{algorithm}: global_batch_size {size!r} is not a count of at least the {responses} responses of "
            "this micro-batch: it must count every response of the mini-batch across all data-parallel ranks.")
    if not (_is_count(dp_size) and dp_size >= 1):
        raise InvalidBatchError(f"{algorithm}: dp_size {dp_size!r} in verl's global batch info must be a number >= 1 "
                                "(the count of data-parallel ranks, a finite whole number).")
    return info


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    """A finite whole number (int, or a float such as 8.0), not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _common_metrics(batch: _Batch) -> dict[str, float]:
    metrics = importance_sampling_metrics(batch.log_prob, batch.behaviour_log_prob, batch.mask)
    valid = formulas.valid_rows(batch.mask)
    if bool(valid.any()):
        # Rows whose advantage is exactly 0 carry no learning signal (singleton groups,
        # groups where every response got the same reward).
        row_advantage = batch.advantages.detach().sum(-1)
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


def _loss_metrics(batch: _Batch) -> dict[str, float]:
    """Every metric is over response tokens only; a batch without any has none (empty dict)."""
    metrics = _common_metrics(batch)
    if batch.rollout_log_probs is not None:
        metrics.update(_gap_split_metrics(batch.old_log_prob, batch.log_prob, batch.rollout_log_probs, batch.mask))
    return metrics


def reinforce_zero_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = REQUIRED_LOSS_AGG_MODE,
                               config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                               rollout_log_probs: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE Zero: -(1/B) sum_i (1/T_i) sum_t A_i pi/mu, unclipped.

    mu = ``rollout_log_probs`` when given, else ``old_log_prob`` (bypass mode). Masked
    positions of every input are never read. A batch without response tokens (B = 0,
    T = 0 or every row masked) gives loss 0 with a zero gradient. 16-bit inputs are computed
    in float32; the loss is then float32 and the gradient reaches ``log_prob`` in its dtype.
    Raises :class:`InvalidBatchError` for NaN/inf or positive (beyond rounding) logprobs or
    NaN/inf advantages at response tokens, and for a loss that overflows."""
    batch = _checked_batch("reinforce_zero", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                           rollout_is_weights, rollout_log_probs)
    loss_mat, _ = formulas.reinforce_zero_token_loss(batch.log_prob, batch.behaviour_log_prob, batch.advantages)
    loss = _aggregate(loss_mat, batch, loss_agg_mode, config, "reinforce_zero")
    return loss, _loss_metrics(batch)


def _trust_region_settings(config: Any) -> tuple[float, str]:
    """(delta, KL direction) from ``config.policy_loss``; refused when a NaN or non-positive
    delta would reject every row (the config class refuses them too, but a config can be
    changed after it was built)."""
    policy_loss = getattr(config, "policy_loss", None) if config is not None else None
    if policy_loss is None:
        return DEFAULT_TRUST_REGION_DELTA, "behaviour_to_learner"
    delta = policy_loss.get("trust_region_delta", DEFAULT_TRUST_REGION_DELTA)
    direction = policy_loss.get("kl_direction", "behaviour_to_learner")
    if not (_is_number(delta) and delta > 0):  # NaN fails too
        raise InvalidBatchError(f"flash_reinforce: actor_rollout_ref.actor.policy_loss.trust_region_delta must be "
                                f"a positive number, got {delta!r}.")
    if direction not in KL_DIRECTIONS:
        raise InvalidBatchError(f"flash_reinforce: actor_rollout_ref.actor.policy_loss.kl_direction must be one of "
                                f"{', '.join(KL_DIRECTIONS)}, got {direction!r}.")
    return float(delta), direction


def flash_reinforce_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = REQUIRED_LOSS_AGG_MODE,
                                config: Any = None, rollout_is_weights: torch.Tensor | None = None,
                                rollout_log_probs: torch.Tensor | None = None,
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """FlashREINFORCE: -(1/B) sum_i (m_i A_i / T_i) sum_t pi/mu, m_i = sequence trust-region gate
    on the mean Bernoulli KL between mu and pi.

    mu = ``rollout_log_probs`` when given, else ``old_log_prob`` (bypass mode). Inputs,
    empty batches, precision and errors as in :func:`reinforce_zero_policy_loss`; the
    trust-region KL is computed in float64."""
    batch = _checked_batch("flash_reinforce", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                           rollout_is_weights, rollout_log_probs)
    delta, direction = _trust_region_settings(config)
    token_kl = formulas.sampled_action_bernoulli_kl(batch.log_prob.detach(), batch.behaviour_log_prob, direction)
    admitted, mean_kl = formulas.sequence_trust_region(token_kl, batch.mask, delta)
    loss_mat, _ = formulas.flash_reinforce_token_loss(batch.log_prob, batch.behaviour_log_prob, batch.advantages,
                                                      admitted)
    # Rejected rows keep their mask, so B (the denominator) still counts them.
    loss = _aggregate(loss_mat, batch, loss_agg_mode, config, "flash_reinforce")
    metrics = _loss_metrics(batch)
    valid = formulas.valid_rows(batch.mask)
    if bool(valid.any()):
        admitted_fraction = admitted[valid].float().mean().item()
        metrics["flash_reinforce/admitted_fraction"] = admitted_fraction
        metrics["flash_reinforce/seq_kl_mean"] = mean_kl[valid].float().mean().item()
        # Same meaning as verl's sequence rejection-sampling metric.
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = 1.0 - admitted_fraction
    return loss, metrics
