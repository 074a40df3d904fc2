"""Both estimators through verl's own compute_advantage, with padding rows, groups, singletons."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl  # noqa: F401  (loads the plugin through its entry point)
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

from zero_mismatch_plugin.verl_adapter import estimators

BYPASS = OmegaConf.create({"rollout_correction": {"bypass_mode": True}})


def _batch() -> DataProto:
    # rows: group a (3 rows), group b (2), singleton c, two verl padding rows (mask 0, shared pad uid)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 3.0, 9.0, 9.0])
    lengths = [3, 2, 4, 1, 4, 2, 0, 0]
    token_rewards = torch.zeros(8, 4)
    mask = torch.zeros(8, 4)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        token_rewards[row, max(length - 1, 0)] = rewards[row]
    uids = np.array(["a", "a", "a", "b", "b", "c", "pad0", "pad0"], dtype=object)
    return DataProto.from_dict(tensors={"token_level_rewards": token_rewards, "response_mask": mask},
                               non_tensors={"uid": uids})


def _row_advantage(data: DataProto) -> torch.Tensor:
    adv = data.batch["advantages"]
    mask = data.batch["response_mask"]
    # advantage is constant over a row's tokens and zero outside the mask
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))
    return adv[:, 0] * (mask.sum(-1) > 0)


def test_reinforce_zero_through_verl_compute_advantage():
    data = compute_advantage(_batch(), adv_estimator="reinforce_zero", config=BYPASS)
    expected = torch.tensor([0.5, -0.5, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0])
    assert torch.allclose(_row_advantage(data), expected)
    assert torch.equal(data.batch["returns"], data.batch["advantages"])
    assert estimators.last_advantage_stats["reinforce_zero/singleton_groups"] == 1.0
    assert estimators.last_advantage_stats["reinforce_zero/valid_rows"] == 6.0


def test_flash_reinforce_through_verl_compute_advantage():
    data = compute_advantage(_batch(), adv_estimator="flash_reinforce", config=BYPASS)
    mean = (1.0 + 0.0 + 0.5 + 2.0 + 0.0 + 3.0) / 6
    expected = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 3.0, 0.0, 0.0]) - mean
    expected[6:] = 0.0
    assert torch.allclose(_row_advantage(data), expected)


@pytest.mark.parametrize("name", ["reinforce_zero", "flash_reinforce"])
def test_estimators_refuse_bypass_off(name):
    config = OmegaConf.create({"rollout_correction": {"bypass_mode": False}})
    with pytest.raises(ValueError, match="algorithm.rollout_correction.bypass_mode=true"):
        compute_advantage(_batch(), adv_estimator=name, config=config)


@pytest.mark.parametrize("name", ["reinforce_zero", "flash_reinforce"])
def test_estimators_accept_bypass_off_when_verl_passes_mu_to_the_loss(name, monkeypatch):
    from verl.workers.utils import losses

    from zero_mismatch_plugin.verl_adapter import ROLLOUT_LOG_PROBS_MARKER

    # What verl patch 0003 sets in verl.workers.utils.losses.
    monkeypatch.setattr(losses, ROLLOUT_LOG_PROBS_MARKER, True, raising=False)
    decoupled = compute_advantage(_batch(), adv_estimator=name,
                                  config=OmegaConf.create({"rollout_correction": {"bypass_mode": False}}))
    bypass = compute_advantage(_batch(), adv_estimator=name, config=BYPASS)
    assert torch.equal(decoupled.batch["advantages"], bypass.batch["advantages"])


def test_estimators_refuse_non_finite_rewards():
    data = _batch()
    data.batch["token_level_rewards"][1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite reward in rows \[1\]"):
        compute_advantage(data, adv_estimator="reinforce_zero", config=BYPASS)


def test_reinforce_zero_needs_uids():
    with pytest.raises(ValueError, match="uid"):
        estimators.reinforce_zero_advantage(torch.ones(2, 2), torch.ones(2, 2), config=BYPASS, index=None)
