"""Bad input to the advantage estimators ``reinforce_zero`` and ``flash_reinforce``, called as
verl's ``compute_advantage`` calls them: anything in the padding, rewards near the float32
limit, uids that are missing or not one per row, shapes, masks and dtypes verl never passes,
and empty batches.

Documented in docs/algorithms.md, "Bad input" (and in the estimators' docstrings).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from omegaconf import OmegaConf

from support.bad_input import error, result

from zero_mismatch_plugin.algorithms import formulas
from zero_mismatch_plugin.integrations.verl import estimators
from zero_mismatch_plugin.integrations.verl.estimators import InvalidBatchError

DOC = "docs/algorithms.md, 'Bad input: the estimators'"
BYPASS = OmegaConf.create({"rollout_correction": {"bypass_mode": True}})
ESTIMATORS = {"reinforce_zero": estimators.reinforce_zero_advantage,
              "flash_reinforce": estimators.flash_reinforce_advantage}
NAMES = tuple(ESTIMATORS)
# rows: group a (3 rows), group b (2), singleton c, two verl padding rows (mask 0)
LENGTHS = (3, 2, 4, 1, 4, 2, 0, 0)
REWARDS = (1.0, 0.0, 0.5, 2.0, 0.0, 3.0, 0.0, 0.0)
UIDS = ("a", "a", "a", "b", "b", "c", "pad0", "pad0")


def _batch():
    mask = torch.arange(4).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    rewards = torch.zeros(mask.shape)
    for row, (length, reward) in enumerate(zip(LENGTHS, REWARDS)):
        rewards[row, max(length - 1, 0)] = reward
    return rewards, mask.float(), np.array(UIDS, dtype=object)


def _call(name: str, rewards, mask, index):
    return ESTIMATORS[name](rewards, mask, config=BYPASS, index=index)[0]


def _changed(name: str, change):
    """Run the estimator on the standard batch after ``change(inputs)`` edits it in place."""
    def run():
        rewards, mask, uids = _batch()
        inputs = {"rewards": rewards, "mask": mask, "index": uids}
        change(inputs)
        return _call(name, inputs["rewards"], inputs["mask"], inputs["index"])
    return run


def _unchanged(_inputs):
    return None


# ----- padding: whatever it holds, the advantages are those of clean padding ------------------

POISONS = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"), "3e38": 3e38, "-3e38": -3e38}


def _poisoned_and_clean(name: str, value: float):
    def poison(inputs):
        inputs["rewards"] = torch.where(inputs["mask"].bool(), inputs["rewards"], value)
    return lambda: (_changed(name, poison)(), _changed(name, _unchanged)())


def _row_advantages(advantages, expected):
    assert torch.allclose(advantages[:, 0], torch.tensor(expected)), advantages[:, 0]


def _bit_identical(pair):
    poisoned, clean = pair
    assert torch.equal(poisoned, clean), (poisoned, clean)
    assert torch.isfinite(clean).all()


PADDING = [
    result(f"{name}-padding-rewards-{label}", _poisoned_and_clean(name, value), _bit_identical, DOC)
    for name in NAMES for label, value in POISONS.items()
]


# ----- rewards near the float32 limit: computed in float64; refused when A does not fit ----------

def _rows(*row_rewards: float, tokens: int = 1):
    """A batch of one-prompt rows, ``tokens`` tokens each, every token carrying the row's reward."""
    def change(inputs):
        count = len(row_rewards)
        inputs["rewards"] = torch.tensor(row_rewards).unsqueeze(-1).expand(count, tokens).clone()
        inputs["mask"] = torch.ones(count, tokens)
        inputs["index"] = np.array(["p"] * count, dtype=object)
    return change


def _advantages_are(*expected: float):
    def check(advantages):
        assert torch.isfinite(advantages).all(), advantages
        assert torch.allclose(advantages[:, 0].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6)
    return check


HUGE_REWARDS = [
    result(f"{name}-rewards-plus-minus-3e38", _changed(name, _rows(3e38, -3e38)), _advantages_are(3e38, -3e38), DOC)
    for name in NAMES
] + [
    # Per-token rewards of 2e38 sum to 4e38 (past float32) in a row; the advantage 3e38 fits.
    result(f"{name}-row-sum-past-float32", _changed(name, _rows(2e38, 0.0, 0.0, 0.0, tokens=2)),
           _advantages_are(3e38, -1e38, -1e38, -1e38), DOC)
    for name in NAMES
] + [
    error(f"{name}-advantage-past-float32", _changed(name, _rows(3e38, 3e38, -3e38)),
          r"rows \[2\] .* does not fit torch.float32 .* scale them down", InvalidBatchError)
    for name in NAMES
] + [
    error(f"{name}-float64-rewards-summing-to-inf", _changed(name, lambda i: (
        _rows(1e308, 0.0, tokens=2)(i), i.update(rewards=i["rewards"].double()))),
        r"non-finite reward in rows \[0\]", InvalidBatchError)
    for name in NAMES
]

def _in_fp16(change):
    def fp16(inputs):
        change(inputs)
        inputs["rewards"] = inputs["rewards"].half()
    return fp16


HUGE_REWARDS += [
    result(f"{name}-float16-rewards-plus-minus-60000", _changed(name, _in_fp16(_rows(6e4, -6e4))),
           _advantages_are(6e4, -6e4), DOC)
    for name in NAMES
] + [
    error(f"{name}-float16-advantage-past-65504", _changed(name, _in_fp16(_rows(65504.0, 65504.0, -65504.0))),
          r"rows \[2\] .* does not fit torch.float16", InvalidBatchError)
    for name in NAMES
]

BF16_NEAR_MAX = 1.75 * 2.0**127  # 3.0e38, exact in bfloat16
HUGE_REWARDS += [
    result(f"{name}-bfloat16-rewards-plus-minus-3e38", _changed(
        name, lambda i: (_rows(BF16_NEAR_MAX, -BF16_NEAR_MAX)(i), i.update(rewards=i["rewards"].bfloat16()))),
        _advantages_are(BF16_NEAR_MAX, -BF16_NEAR_MAX), DOC)
    for name in NAMES
]

NON_FINITE = [
    error(f"{name}-{label}-reward-at-a-response-token", _changed(name, lambda i, v=value: i["rewards"].__setitem__(
        (1, 0), v)), r"non-finite reward in rows \[1\]; check the reward function", InvalidBatchError)
    for name in NAMES for label, value in (("nan", float("nan")), ("+inf", float("inf")), ("-inf", float("-inf")))
]


# ----- uids (REINFORCE Zero's groups) ---------------------------------------------------------

def _uids(*rows_and_values):
    def change(inputs):
        for row, value in rows_and_values:
            inputs["index"][row] = value
    return change


def _index(value):
    return lambda inputs: inputs.update(index=value)


UID_CASES = [
    error(f"reinforce_zero-{label}-uids", _changed("reinforce_zero", _uids((1, value), (4, value))),
          r"rows \[1, 4\] have no uid \(None/NaN\)", InvalidBatchError)
    for label, value in (("none", None), ("nan", float("nan")), ("float32-nan", np.float32("nan")))
] + [
    error("reinforce_zero-every-uid-none", _changed("reinforce_zero", _index(np.array([None] * 8, dtype=object))),
          r"rows \[0, 1, 2, 3, 4, 5\] have no uid", InvalidBatchError),
    error("reinforce_zero-no-index", _changed("reinforce_zero", _index(None)),
          r"needs the prompt uid of every row \(verl's non_tensor_batch\['uid'\]\)", InvalidBatchError),
    error("reinforce_zero-unhashable-uids", _changed("reinforce_zero", _index(np.array(
        [["a"], ["a"], ["a"], ["b"], ["b"], ["c"], ["p"], ["p", "q"]], dtype=object))),
        "uids must be strings or numbers", InvalidBatchError),
] + [
    error(f"reinforce_zero-index-{label}", _changed("reinforce_zero", _index(value)),
          "index must hold one uid per row", InvalidBatchError)
    for label, value in (("one-short", np.array(UIDS[:-1], dtype=object)), ("one-long", list(UIDS) + ["x"]),
                         ("2-D", np.array(UIDS).reshape(2, 4)), ("a-string", "a"), ("a-number", 7))
] + [
    error("reinforce_zero-float-uids-with-nan", _changed("reinforce_zero", _index(
        np.array([0.0, 0.0, np.nan, 1.0, 1.0, 2.0, 9.0, 9.0]))), r"rows \[2\] have no uid", InvalidBatchError),
] + [
    result("reinforce_zero-padding-row-without-uid", lambda: (
        _changed("reinforce_zero", _uids((6, None), (7, float("nan"))))(),
        _changed("reinforce_zero", _unchanged)()), _bit_identical, DOC),
    # 1 and "1" are different uids: grouped by equality, never by their text
    result("reinforce_zero-uid-1-and-text-1", _changed("reinforce_zero", _index(
        np.array([1, 1, "1", "b", "b", "c", "p", "p"], dtype=object))),
        lambda advantages: _row_advantages(advantages, [0.5, -0.5, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0]), DOC),
    result("reinforce_zero-integer-uids", lambda: (
        _changed("reinforce_zero", _index(torch.tensor([0, 0, 0, 1, 1, 2, 9, 9])))(),
        _changed("reinforce_zero", _unchanged)()), _bit_identical, DOC),
]


# ----- shapes, masks, dtypes, empty batches ----------------------------------------------------

SHAPES = [
    error(f"{name}-{label}", _changed(name, change), r"must both be \(batch, response length\), with the same shape",
          InvalidBatchError)
    for name in NAMES
    for label, change in (
        ("mask-one-column-short", lambda i: i.update(mask=i["mask"][:, :-1])),
        ("rewards-one-row-short", lambda i: i.update(rewards=i["rewards"][:-1])),
        ("1-D-inputs", lambda i: i.update(rewards=i["rewards"][:, 0], mask=i["mask"][:, 0])),
        ("3-D-inputs", lambda i: i.update(rewards=i["rewards"][None], mask=i["mask"][None])),
    )
]


def _mask_value(value: float):
    def change(inputs):
        inputs["mask"][1, 0] = value
    return change


MASKS = [
    error(f"{name}-mask-holding-{value}", _changed(name, _mask_value(value)), "response_mask must hold only 0 and 1",
          InvalidBatchError)
    for name in NAMES for value in (0.5, -1.0, float("nan"))
] + [
    error(f"{name}-mask-as-numpy", _changed(name, lambda i: i.update(mask=i["mask"].numpy())),
          "response_mask must be a torch.Tensor", InvalidBatchError)
    for name in NAMES
] + [
    result(f"{name}-bool-mask", lambda name=name: (_changed(name, lambda i: i.update(mask=i["mask"].bool()))(),
                                                   _changed(name, _unchanged)()), _bit_identical, DOC)
    for name in NAMES
]

DTYPES = [
    error(f"{name}-integer-rewards", _changed(name, lambda i: i.update(rewards=i["rewards"].long())),
          r"token_level_rewards must be floating-point, got torch.int64: convert the rewards with .float\(\)",
          InvalidBatchError)
    for name in NAMES
] + [
    error(f"{name}-rewards-as-list", _changed(name, lambda i: i.update(rewards=i["rewards"].tolist())),
          "token_level_rewards must be a floating-point torch.Tensor", InvalidBatchError)
    for name in NAMES
]


def _empty_advantages(shape):
    def check(advantages):
        assert advantages.shape == shape and not advantages.any(), advantages
    return check


def _empty(name: str, rows: int, tokens: int):
    return lambda: _call(name, torch.zeros(rows, tokens), torch.zeros(rows, tokens), np.array(["p"] * rows))


EMPTY = [
    result(f"{name}-{label}", _empty(name, rows, tokens), _empty_advantages((rows, tokens)), DOC)
    for name in NAMES for label, rows, tokens in (("no-rows", 0, 4), ("no-tokens", 3, 0), ("every-row-masked", 3, 4))
]

SETTINGS = [
    error(f"{name}-bypass-off-on-stock-verl", lambda name=name: ESTIMATORS[name](
        *_batch()[:2], config=OmegaConf.create({"rollout_correction": {"bypass_mode": False}}), index=_batch()[2]),
        "set algorithm.rollout_correction.bypass_mode=true", InvalidBatchError)
    for name in NAMES
]

def _with_config(name: str, config):
    rewards, mask, uids = _batch()
    return ESTIMATORS[name](rewards, mask, config=config, index=uids)[0], _changed(name, _unchanged)()


SETTINGS += [
    result(f"{name}-algorithm-config-as-{label}", lambda name=name, config=config: _with_config(name, config),
           _bit_identical, DOC)
    for name in NAMES
    for label, config in (("dict", {"rollout_correction": {"bypass_mode": True}}),
                          ("object", SimpleNamespace(rollout_correction=SimpleNamespace(bypass_mode=True))))
]

SETTINGS += [
    # bool("false") is True: a string or a number would switch bypass on without a word
    error(f"{name}-bypass_mode-{label}", lambda name=name, value=value: _with_config(
        name, {"rollout_correction": {"bypass_mode": value}}),
        r"algorithm.rollout_correction.bypass_mode must be true or false \(a boolean\)", InvalidBatchError)
    for name in NAMES for label, value in (("text-false", "false"), ("text-true", "true"), ("1", 1))
]


# The framework-free formulas the estimators are built from (zero_mismatch_plugin/algorithms/formulas.py):
# tensors of one shape, never broadcast; group ids an index >= 0.
_REWARDS, _VALID = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([True, True, True])
BROADCAST = "Broadcasting is refused"
FORMULAS = [
    error(f"formulas-{label}", run, says, ValueError)
    for label, run, says in (
        ("outcome_reward-mask-per-row", lambda: formulas.outcome_reward(torch.ones(3, 4), torch.ones(3, 1)),
         rf"outcome_reward: response_mask has shape \(3, 1\), but token_level_rewards has \(3, 4\).*{BROADCAST}"),
        ("outcome_reward-1-D", lambda: formulas.outcome_reward(torch.ones(4), torch.ones(4)),
         r"outcome_reward: token_level_rewards must be 2-D \(batch, response length\), got shape \(4,\)"),
        ("valid_rows-1-D", lambda: formulas.valid_rows(torch.ones(4)),
         r"valid_rows: response_mask must be 2-D \(batch, response length\)"),
        # one True would take the sum of every reward for the mean
        ("batch_centered_advantage-one-valid", lambda: formulas.batch_centered_advantage(
            _REWARDS, torch.tensor([True])), rf"valid has shape \(1,\), but rewards has \(3,\).*{BROADCAST}"),
        ("batch_centered_advantage-float-valid", lambda: formulas.batch_centered_advantage(
            _REWARDS, torch.ones(3)), r"batch_centered_advantage: valid must be a bool tensor"),
        ("group_centered_advantage-one-valid", lambda: formulas.group_centered_advantage(
            _REWARDS, torch.tensor([0, 0, 1]), torch.tensor([True])),
         r"group_centered_advantage: valid has shape \(1,\), but rewards has \(3,\)"),
        ("group_centered_advantage-group_ids-per-column", lambda: formulas.group_centered_advantage(
            _REWARDS, torch.tensor([[0, 0, 1]]), _VALID), r"group_ids has shape \(1, 3\), but rewards has \(3,\)"),
        ("group_centered_advantage-negative-group-id", lambda: formulas.group_centered_advantage(
            _REWARDS, torch.tensor([0, -1, 1]), _VALID), r"group_ids must be >= 0 \(an index 0..G-1\), got -1"),
        ("group_centered_advantage-float-group-ids", lambda: formulas.group_centered_advantage(
            _REWARDS, torch.tensor([0.0, 0.0, 1.0]), _VALID), r"group_ids must be an integer tensor"),
        ("group_centered_advantage-float-valid", lambda: formulas.group_centered_advantage(
            _REWARDS, torch.tensor([0, 0, 1]), torch.ones(3)), r"group_centered_advantage: valid must be a bool"),
    )
]

CASES = [*PADDING, *HUGE_REWARDS, *NON_FINITE, *UID_CASES, *SHAPES, *MASKS, *DTYPES, *EMPTY, *SETTINGS, *FORMULAS]
