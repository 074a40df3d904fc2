"""verl advantage estimators ``reinforce_zero`` and ``flash_reinforce``.

verl calls them on the driver as ``fn(token_level_rewards, response_mask, config=..., index=<uids>, ...)``
and expects ``(advantages, returns)``, both ``(B, T)``. Computed in float64, returned in the rewards'
dtype; padding gets advantage 0. Bad batches raise :class:`InvalidBatchError` (docs/algorithms.md).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from zero_mismatch_plugin.algorithms import formulas
from zero_mismatch_plugin.integrations.verl import verl_passes_rollout_log_probs

logger = logging.getLogger(__name__)

# What the most recent call saw. verl's estimator contract has no metrics channel, so the
# count of singleton groups is kept here (and logged) for drivers that want to report it.
last_advantage_stats: dict[str, float] = {}


class InvalidBatchError(ValueError):
    """A batch the algorithm cannot train on correctly. The message names what to change."""


def _require_bypass_mode(config: Any, algorithm: str) -> None:
    """The losses need the rollout's own mu: as old_log_prob (bypass mode), or as their own
    ``rollout_log_probs`` input from a verl whose ppo_loss passes it (verl patch 0003)."""
    if config is None:  # called outside a trainer (tests, notebooks)
        return
    bypass = _setting(_setting(config, "rollout_correction"), "bypass_mode")
    if not isinstance(bypass, bool | np.bool_ | None):
        # bool("false") is True: a string (or a number) would switch bypass on without a word
        raise InvalidBatchError(
            f"{algorithm}: algorithm.rollout_correction.bypass_mode must be true or false (a boolean), got "
            f"{type(bypass).__name__} {bypass!r}.")
    if not bypass and not verl_passes_rollout_log_probs():
        raise InvalidBatchError(
            f"{algorithm} trains on the rollout's recorded logprobs (mu): set "
            "algorithm.rollout_correction.bypass_mode=true "
            "(otherwise verl recomputes old_log_prob with the trainer and the IS ratio is not pi/mu), "
            "or run a verl whose ppo_loss passes rollout_log_probs to the loss (patches/verl/0003)."
        )


def _setting(node: Any, key: str) -> Any:
    """``node[key]`` of a DictConfig, a dict or a verl config dataclass; None when absent."""
    if node is None:
        return None
    getter = getattr(node, "get", None)
    return getter(key, None) if callable(getter) else getattr(node, key, None)


def _checked_inputs(algorithm: str, token_level_rewards: Any, response_mask: Any) -> torch.Tensor:
    """Refuse inputs verl would never pass; return the response mask as bool."""
    if not isinstance(token_level_rewards, torch.Tensor):
        raise InvalidBatchError(f"{algorithm}: token_level_rewards must be a floating-point torch.Tensor of shape "
                                f"(batch, response length), got {type(token_level_rewards).__name__}.")
    if not token_level_rewards.is_floating_point():
        raise InvalidBatchError(f"{algorithm}: token_level_rewards must be floating-point, got "
                                f"{token_level_rewards.dtype}: convert the rewards with .float().")
    mask = bool_response_mask(algorithm, response_mask)
    if token_level_rewards.dim() != 2 or mask.shape != token_level_rewards.shape:
        raise InvalidBatchError(
            f"{algorithm}: token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(mask.shape)} must both be (batch, response length), with the same shape.")
    return mask


def bool_response_mask(algorithm: str, response_mask: Any) -> torch.Tensor:
    """The response mask as bool (estimators and losses); a numeric mask must hold only 0 and 1."""
    if not isinstance(response_mask, torch.Tensor):
        raise InvalidBatchError(f"{algorithm}: response_mask must be a torch.Tensor (bool or 0/1) of shape "
                                f"(batch, response length), got {type(response_mask).__name__}.")
    if response_mask.dtype == torch.bool:
        return response_mask
    if response_mask.is_complex() or not bool(((response_mask == 0) | (response_mask == 1)).all()):
        raise InvalidBatchError(f"{algorithm}: response_mask must hold only 0 and 1 (1 = response token, "
                                "0 = padding); pass a bool tensor or a 0/1 tensor.")
    return response_mask.bool()


def _outcome_rewards(algorithm: str, token_level_rewards: torch.Tensor, mask: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """R_i in float64 (sums of float32-range rewards cannot overflow there); padding never read."""
    rewards = formulas.outcome_reward(token_level_rewards.double(), mask)
    bad = ~torch.isfinite(rewards) & valid
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()[:8]
        raise InvalidBatchError(f"{algorithm}: non-finite reward in rows {rows}; check the reward function.")
    return rewards


def _in_reward_dtype(algorithm: str, advantages: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    """Per-row float64 advantages as (B, T) in the rewards' dtype, 0 at padding; refuse any
    that the dtype cannot hold (it would become inf)."""
    too_large = advantages.abs() > torch.finfo(dtype).max
    if bool(too_large.any()):
        rows = too_large.nonzero().flatten().tolist()[:8]
        raise InvalidBatchError(
            f"{algorithm}: the advantage of rows {rows} (|A| up to {advantages.abs().max().item():.3g}) does not "
            f"fit {dtype} (max {torch.finfo(dtype).max:.3g}): rewards this large cannot train; scale them down.")
    return torch.where(mask, advantages.unsqueeze(-1), 0.0).to(dtype)


def _is_missing(uid: Any) -> bool:
    return uid is None or (isinstance(uid, (float, np.floating)) and bool(np.isnan(uid)))


def _group_ids(index: Any, valid: torch.Tensor) -> torch.Tensor:
    """Group index 0..G-1 of every row, from its prompt uid. A row without a uid (None or
    NaN) cannot be placed in a group: refused unless the row is padding (mask all 0)."""
    if index is None:
        raise InvalidBatchError(
            "reinforce_zero needs the prompt uid of every row (verl's non_tensor_batch['uid']) to form groups."
        )
    uids = np.asarray(index)
    batch_size = valid.shape[0]
    if uids.ndim != 1 or uids.shape[0] != batch_size:
        raise InvalidBatchError(f"reinforce_zero: index must hold one uid per row: got shape {uids.shape} "
                                f"for {batch_size} rows.")
    uids = uids.tolist()
    missing = [row for row, uid in enumerate(uids) if _is_missing(uid) and bool(valid[row])]
    if missing:
        raise InvalidBatchError(
            f"reinforce_zero: rows {missing[:8]} have no uid (None/NaN): every response needs the uid of its "
            "prompt (verl's non_tensor_batch['uid']), or it would be centered with unrelated responses.")
    group_of: dict[Any, int] = {}
    try:
        return torch.tensor([group_of.setdefault(uid, len(group_of)) for uid in uids], dtype=torch.long)
    except TypeError as unhashable:
        raise InvalidBatchError(f"reinforce_zero: uids must be strings or numbers ({unhashable}).") from None


def reinforce_zero_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                             config: Any = None, index: Any = None, **kwargs: Any
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-centered outcome advantage (see formulas.group_centered_advantage).

    Computed in float64 and returned in the dtype of ``token_level_rewards``, exactly 0 at
    padding (whatever ``token_level_rewards`` holds there) and on rows with an all-zero mask.
    Empty batches (B = 0 or T = 0) give empty advantages. Raises :class:`InvalidBatchError`
    for inputs of the wrong type or shape, a mask other than 0/1, non-finite rewards at
    response tokens, an advantage beyond the dtype's range, and missing (None/NaN) uids."""
    _require_bypass_mode(config, "reinforce_zero")
    with torch.no_grad():
        mask = _checked_inputs("reinforce_zero", token_level_rewards, response_mask)
        valid = formulas.valid_rows(mask)
        group_ids = _group_ids(index, valid).to(token_level_rewards.device)
        rewards = _outcome_rewards("reinforce_zero", token_level_rewards, mask, valid)
        advantages, singleton = formulas.group_centered_advantage(rewards, group_ids, valid)
        num_singletons = int(singleton.sum())
        last_advantage_stats.clear()
        last_advantage_stats.update({
            "reinforce_zero/singleton_groups": float(num_singletons),
            "reinforce_zero/valid_rows": float(valid.sum()),
        })
        if num_singletons:
            logger.warning(
                "reinforce_zero: %d of %d responses are alone in their group and get advantage 0 "
                "(set actor_rollout_ref.rollout.n>1, or use flash_reinforce for one rollout per prompt).",
                num_singletons, int(valid.sum()))
        advantages = _in_reward_dtype("reinforce_zero", advantages, mask, token_level_rewards.dtype)
    return advantages, advantages


def flash_reinforce_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                              config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-centered outcome advantage (see formulas.batch_centered_advantage).

    Precision, padding, empty batches and errors as in :func:`reinforce_zero_advantage`
    (no uids needed)."""
    _require_bypass_mode(config, "flash_reinforce")
    with torch.no_grad():
        mask = _checked_inputs("flash_reinforce", token_level_rewards, response_mask)
        valid = formulas.valid_rows(mask)
        rewards = _outcome_rewards("flash_reinforce", token_level_rewards, mask, valid)
        advantages = _in_reward_dtype("flash_reinforce", formulas.batch_centered_advantage(rewards, valid), mask,
                                      token_level_rewards.dtype)
        last_advantage_stats.clear()
        last_advantage_stats["flash_reinforce/valid_rows"] = float(valid.sum())
    return advantages, advantages
