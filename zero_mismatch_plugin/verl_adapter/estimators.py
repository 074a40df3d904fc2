"""verl advantage estimators ``reinforce_zero`` and ``flash_reinforce``.

verl calls them on the driver as
``fn(token_level_rewards, response_mask, config=<algorithm config>, index=<uids>, ...)``
and expects ``(advantages, returns)``, both ``(B, T)``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from zero_mismatch_plugin import formulas
from zero_mismatch_plugin.verl_adapter import verl_passes_rollout_log_probs

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
    rollout_correction = config.get("rollout_correction", None)
    bypass = rollout_correction is not None and bool(rollout_correction.get("bypass_mode", False))
    if not bypass and not verl_passes_rollout_log_probs():
        raise InvalidBatchError(
            f"{algorithm} trains on the rollout's recorded logprobs (mu): set "
            "algorithm.rollout_correction.bypass_mode=true "
            "(otherwise verl recomputes old_log_prob with the trainer and the IS ratio is not pi/mu), "
            "or run a verl whose ppo_loss passes rollout_log_probs to the loss (patches/verl/0003)."
        )


def _check_rewards(rewards: torch.Tensor, valid: torch.Tensor, algorithm: str) -> None:
    bad = ~torch.isfinite(rewards) & valid
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()[:8]
        raise InvalidBatchError(f"{algorithm}: non-finite reward in rows {rows}; check the reward function.")


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_row.unsqueeze(-1) * response_mask.to(per_row.dtype)


def _group_ids(index: Any, batch_size: int) -> torch.Tensor:
    if index is None:
        raise InvalidBatchError(
            "reinforce_zero needs the prompt uid of every row (verl's non_tensor_batch['uid']) to form groups."
        )
    index = np.asarray(index)
    if index.shape[0] != batch_size:
        raise InvalidBatchError(f"reinforce_zero: {index.shape[0]} uids for {batch_size} rows.")
    _, inverse = np.unique(index.astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


def reinforce_zero_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                             config: Any = None, index: Any = None, **kwargs: Any
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-centered outcome advantage (see formulas.group_centered_advantage)."""
    _require_bypass_mode(config, "reinforce_zero")
    with torch.no_grad():
        valid = formulas.valid_rows(response_mask)
        rewards = formulas.outcome_reward(token_level_rewards, response_mask)
        _check_rewards(rewards, valid, "reinforce_zero")
        advantages, singleton = formulas.group_centered_advantage(
            rewards, _group_ids(index, rewards.shape[0]).to(rewards.device), valid)
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
        advantages = _broadcast(advantages, response_mask)
    return advantages, advantages


def flash_reinforce_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                              config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-centered outcome advantage (see formulas.batch_centered_advantage)."""
    _require_bypass_mode(config, "flash_reinforce")
    with torch.no_grad():
        valid = formulas.valid_rows(response_mask)
        rewards = formulas.outcome_reward(token_level_rewards, response_mask)
        _check_rewards(rewards, valid, "flash_reinforce")
        advantages = _broadcast(formulas.batch_centered_advantage(rewards, valid), response_mask)
        last_advantage_stats.clear()
        last_advantage_stats["flash_reinforce/valid_rows"] = float(valid.sum())
    return advantages, advantages
