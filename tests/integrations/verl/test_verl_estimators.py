"""Both estimators through verl's own compute_advantage, with padding rows, groups, singletons."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl  # noqa: F401  (loads the plugin through its entry point)
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

from zero_mismatch_plugin.integrations.verl import estimators

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

    from zero_mismatch_plugin.integrations.verl import ROLLOUT_LOG_PROBS_MARKER

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


# ----- bad input ------------------------------------------------------------------------------

ESTIMATORS = {"reinforce_zero": estimators.reinforce_zero_advantage,
              "flash_reinforce": estimators.flash_reinforce_advantage}
UIDS = np.array(["a", "a", "a", "b", "b", "c", "pad0", "pad0"], dtype=object)


def _tensors():
    data = _batch()
    return data.batch["token_level_rewards"].clone(), data.batch["response_mask"].clone()


def _advantages(name, rewards, mask, index=UIDS):
    return ESTIMATORS[name](rewards, mask, config=BYPASS, index=index)[0]


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf"), 3e38, -3e38])
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_whatever_padding_holds_the_advantages_are_bit_identical(name, poison):
    rewards, mask = _tensors()
    clean = _advantages(name, rewards, mask)
    dirty = _advantages(name, torch.where(mask.bool(), rewards, poison), mask)
    assert torch.equal(dirty, clean)
    assert not clean[mask == 0].any()


def test_rewards_near_the_float32_limit_give_finite_advantages_or_a_clear_error():
    mask = torch.ones(4, 2)
    rewards = torch.zeros(4, 2)
    rewards[0] = 2e38  # R_0 = 4e38: beyond fp32 as a sum, fine in float64
    advantages = _advantages("flash_reinforce", rewards, mask)
    assert advantages[:, 0].tolist() == pytest.approx([3e38, -1e38, -1e38, -1e38], rel=1e-6)

    rewards = torch.tensor([[3e38], [-3e38]])
    assert _advantages("flash_reinforce", rewards, torch.ones(2, 1)).flatten().tolist() == pytest.approx(
        [3e38, -3e38], rel=1e-6)
    assert _advantages("reinforce_zero", rewards, torch.ones(2, 1), index=["p", "p"]).flatten().tolist() == \
        pytest.approx([3e38, -3e38], rel=1e-6)

    rewards = torch.tensor([[3e38], [3e38], [-3e38]])  # mean 1e38: row 2 gets -4e38
    for name in ESTIMATORS:
        with pytest.raises(estimators.InvalidBatchError, match=r"rows \[2\] .* does not fit torch.float32"):
            _advantages(name, rewards, torch.ones(3, 1), index=["p"] * 3)


@pytest.mark.parametrize("missing", [None, float("nan"), np.float32("nan")])
def test_rows_without_a_uid_are_refused_not_grouped_together(missing):
    rewards, mask = _tensors()
    uids = UIDS.copy()
    uids[[1, 4]] = missing
    with pytest.raises(estimators.InvalidBatchError, match=r"rows \[1, 4\] have no uid"):
        _advantages("reinforce_zero", rewards, mask, index=uids)


def test_a_padding_row_without_a_uid_is_fine():
    rewards, mask = _tensors()
    uids = UIDS.copy()
    uids[6] = None
    assert torch.equal(_advantages("reinforce_zero", rewards, mask, index=uids), _advantages("reinforce_zero",
                                                                                            rewards, mask))


@pytest.mark.parametrize("index", [UIDS[:5], UIDS.reshape(2, 4), "a", [["a"]] * 8])
def test_an_index_that_is_not_one_uid_per_row_is_refused(index):
    rewards, mask = _tensors()
    with pytest.raises(estimators.InvalidBatchError, match="index must hold one uid per row"):
        _advantages("reinforce_zero", rewards, mask, index=index)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_shapes_other_than_matching_batch_by_length_are_refused(name):
    rewards, mask = _tensors()
    for bad_rewards, bad_mask in ((rewards[:, :3], mask), (rewards[:, 0], mask[:, 0]), (rewards[None], mask[None])):
        with pytest.raises(estimators.InvalidBatchError, match="must both be \\(batch, response length\\)"):
            _advantages(name, bad_rewards, bad_mask)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_masks_other_than_0_1_and_non_tensors_are_refused(name):
    rewards, mask = _tensors()
    half = mask.clone()
    half[0, 0] = 0.5
    with pytest.raises(estimators.InvalidBatchError, match="response_mask must hold only 0 and 1"):
        _advantages(name, rewards, half)
    with pytest.raises(estimators.InvalidBatchError, match="response_mask must be a torch.Tensor"):
        _advantages(name, rewards, mask.numpy())
    with pytest.raises(estimators.InvalidBatchError, match="token_level_rewards must be floating-point"):
        _advantages(name, rewards.long(), mask)


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_empty_batches_give_empty_or_zero_advantages(name, shape):
    advantages = _advantages(name, torch.zeros(shape), torch.zeros(shape), index=["p"] * shape[0])
    assert advantages.shape == shape and not advantages.any()


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_bypass_mode_must_be_a_boolean(name):
    rewards, mask = _tensors()
    index = ["p"] * rewards.shape[0]
    expected = ESTIMATORS[name](rewards, mask, config=BYPASS, index=index)[0]
    numpy_true = {"rollout_correction": {"bypass_mode": np.bool_(True)}}
    assert torch.equal(ESTIMATORS[name](rewards, mask, config=numpy_true, index=index)[0], expected)
    for value in ("false", 1):  # bool("false") is True
        with pytest.raises(estimators.InvalidBatchError, match="bypass_mode must be true or false"):
            ESTIMATORS[name](rewards, mask, config={"rollout_correction": {"bypass_mode": value}}, index=index)
