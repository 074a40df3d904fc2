"""Bad input to the policy losses ``reinforce_zero`` and ``flash_reinforce``, called as verl's
``ppo_loss`` calls them: anything in the padding, 16-bit inputs with ratios past fp16's range,
batches without response tokens, positive or non-finite logprobs, advantages that overflow,
masks, shapes, dtypes and settings that are not what verl passes.

Documented in docs/algorithms.md, "Bad input" (and in the losses' docstrings).
"""

from __future__ import annotations

import math

import numpy as np
import torch

import verl  # noqa: F401  (registers the plugin's losses)
from support.bad_input import error, result
from support.verl_batches import (actor_config, extreme_log_ratio_batch, fill_padding, loss_call, padded_loss_batch,
                          reference_reinforce)

from zero_mismatch_plugin.algorithms import formulas

from zero_mismatch_plugin.algorithms import token_metrics
from zero_mismatch_plugin.integrations.verl.estimators import InvalidBatchError
from zero_mismatch_plugin.integrations.verl.losses import positive_log_prob_tolerance

DOC = "docs/algorithms.md, 'Bad input: the losses'"
LOSS_MODES = ("reinforce_zero", "flash_reinforce")
POISONS = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"), "3e38": 3e38, "-3e38": -3e38}
# What a padded position of each input can hold; "+mu" means mu is passed as rollout_log_probs
# (decoupled mode with verl patch 0003; old_log_prob is then the trainer's recompute).
POISONED_INPUTS = ("log_prob", "old_log_prob", "advantages", "rollout_log_probs+mu", "old_log_prob+mu")


def _inputs(with_mu: bool, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    pi, mu, old, advantages, mask = padded_loss_batch(dtype=dtype)
    inputs = {"log_prob": pi, "old_log_prob": old if with_mu else mu, "advantages": advantages, "mask": mask}
    if with_mu:
        inputs["rollout_log_probs"] = mu
    return inputs


def _call(loss_mode: str, inputs: dict, config=None):
    keywords = {key: inputs[key] for key in ("rollout_log_probs", "rollout_is_weights") if key in inputs}
    return loss_call(loss_mode, inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"], inputs["mask"],
                     config=config, **keywords)


def _changed(loss_mode: str, change, with_mu: bool = False, config=None, dtype: torch.dtype = torch.float32):
    """Run the loss on the standard padded batch after ``change(inputs)`` edits it in place."""
    def run():
        inputs = _inputs(with_mu, dtype)
        change(inputs)
        return _call(loss_mode, inputs, config() if callable(config) else config)
    return run


# ----- padding: whatever it holds, loss, gradient and metrics are those of clean padding ---------

def _poisoned_and_clean(loss_mode: str, poisoned: str, value: float):
    name, _, with_mu = poisoned.partition("+")

    def poison(inputs):
        inputs[name] = fill_padding(inputs[name], inputs["mask"], value)

    return lambda: (_changed(loss_mode, poison, bool(with_mu))(), _changed(loss_mode, lambda _: None, bool(with_mu))())


def _bit_identical(pair):
    (loss, grad, metrics), (clean_loss, clean_grad, clean_metrics) = pair
    assert torch.equal(loss, clean_loss), (loss, clean_loss)
    assert torch.equal(grad, clean_grad), "gradient differs from clean padding"
    assert metrics == clean_metrics, (metrics, clean_metrics)


PADDING = [
    result(f"{loss_mode}-padding-{poisoned}-{label}", _poisoned_and_clean(loss_mode, poisoned, value),
           _bit_identical, DOC)
    for loss_mode in LOSS_MODES for poisoned in POISONED_INPUTS for label, value in POISONS.items()
]


# ----- 16-bit inputs: ratios computed in fp32, gradients finite in the input dtype ---------------

def _low_precision(loss_mode: str, dtype: torch.dtype, columns: slice):
    def run():
        pi, mu, advantages, mask = extreme_log_ratio_batch(dtype)
        mask = mask.clone()
        keep = torch.zeros_like(mask)
        keep[:, columns] = True
        mask &= keep
        config = actor_config(loss_mode, trust_region_delta=1e9) if loss_mode == "flash_reinforce" else None
        return dtype, (pi, mu, advantages, mask), loss_call(loss_mode, pi, mu, advantages, mask, config=config)
    return run


def _matches_fp64_reference(outcome):
    dtype, (pi, mu, advantages, mask), (loss, grad, metrics) = outcome
    reference_loss, reference_grad, capped_fraction = reference_reinforce(pi, mu, advantages, mask,
                                                                          formulas.log_ratio_cap(dtype))
    assert grad.dtype == dtype and torch.isfinite(grad).all(), grad
    assert math.isclose(loss.item(), reference_loss, rel_tol=1e-6), (loss.item(), reference_loss)
    # One rounding to the gradient's dtype, or fp32 arithmetic on log-ratios up to 60 (a few 1e-6).
    tolerance = max(torch.finfo(dtype).eps, 1e-5)
    assert torch.allclose(grad.double(), reference_grad.to(dtype).double(), rtol=tolerance, atol=0)
    assert math.isclose(metrics["zero_mismatch/is_log_ratio_capped_fraction"], capped_fraction, rel_tol=1e-6)


LOW_PRECISION = [
    result(f"{loss_mode}-{str(dtype)[6:]}-log-ratios-{label}", _low_precision(loss_mode, dtype, columns),
           _matches_fp64_reference, DOC)
    for loss_mode in LOSS_MODES for dtype in (torch.float16, torch.bfloat16)
    # columns 2-4: log-ratios 10.5, 11.5, 12 (fp16's exp overflows above 11.09); 4-6: 12, 20, 60 (past the cap)
    for label, columns in (("10.5-to-12", slice(2, 5)), ("12-to-60", slice(4, 7)))
]


def _mixed_dtypes(loss_mode: str, log_prob_dtype: torch.dtype, mu_dtype: torch.dtype):
    def run():
        pi, mu, advantages, mask = extreme_log_ratio_batch(torch.float64)
        return log_prob_dtype, (pi.to(log_prob_dtype), mu.to(mu_dtype), advantages, mask), loss_call(
            loss_mode, pi.to(log_prob_dtype), mu.to(mu_dtype), advantages.float(), mask,
            config=actor_config(loss_mode, trust_region_delta=1e9) if loss_mode == "flash_reinforce" else None)
    return run


MIXED = [
    result(f"{loss_mode}-log_prob-{str(a)[6:]}-mu-{str(b)[6:]}", _mixed_dtypes(loss_mode, a, b),
           _matches_fp64_reference, DOC)
    for loss_mode in LOSS_MODES for a, b in ((torch.float16, torch.float32), (torch.float32, torch.bfloat16))
]


# ----- batches without response tokens: loss 0, zero gradients, no metrics ---------------------

def _empty(loss_mode: str, cut, mask_every_row: bool = False):
    def run():
        pi, mu, _, advantages, mask = (cut(t) for t in padded_loss_batch())
        if mask_every_row:
            mask = torch.zeros_like(mask)
        return pi.shape, loss_call(loss_mode, pi, mu, advantages, mask)
    return run


def _zero_loss_zero_gradient(outcome):
    shape, (loss, grad, metrics) = outcome
    assert loss.item() == 0.0 and grad is not None and grad.shape == shape and not grad.any(), (loss, grad)
    assert metrics == {}, metrics


EMPTY = [
    result(f"{loss_mode}-{label}", _empty(loss_mode, cut, mask_every_row), _zero_loss_zero_gradient, DOC)
    for loss_mode in LOSS_MODES
    for label, cut, mask_every_row in (("no-rows", lambda t: t[:0], False), ("no-tokens", lambda t: t[:, :0], False),
                                       ("every-row-masked", lambda t: t, True))
]


# ----- logprobs that no policy gives ----------------------------------------------------------

def _set_token(name: str, value: float, row: int = 2, column: int = 3):
    def change(inputs):
        inputs[name] = inputs[name].clone()
        inputs[name][row, column] = value
    return change


POSITIVE = [
    error(f"{loss_mode}-positive-{name}{'+mu' if with_mu else ''}",
          _changed(loss_mode, _set_token(name, 0.25), with_mu),
          rf"{name}[ )=].* is positive at 1 response tokens .* check that this input holds the log-probability",
          InvalidBatchError)
    for loss_mode in LOSS_MODES
    for name, with_mu in (("log_prob", False), ("old_log_prob", False), ("rollout_log_probs", True),
                          ("old_log_prob", True))
] + [
    error(f"{loss_mode}-logits-as-log_prob", _changed(loss_mode, lambda inputs: inputs.update(
        log_prob=torch.where(inputs["mask"], torch.full_like(inputs["log_prob"], 7.5), 0.0))),
        r"trainer logprob \(log_prob\) is positive at 20 response tokens .* not a logit", InvalidBatchError)
    for loss_mode in LOSS_MODES
]


def _at_tolerance(loss_mode: str, dtype: torch.dtype):
    return _changed(loss_mode, _set_token("log_prob", positive_log_prob_tolerance(dtype)), dtype=dtype)


def _finite(outcome):
    loss, grad, metrics = outcome
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    assert all(math.isfinite(value) for value in metrics.values()), metrics


AT_TOLERANCE = [
    result(f"{loss_mode}-log_prob-at-rounding-tolerance-{str(dtype)[6:]}", _at_tolerance(loss_mode, dtype),
           _finite, DOC)
    for loss_mode in LOSS_MODES for dtype in (torch.float32, torch.bfloat16)
]

NON_FINITE = [
    error(f"{loss_mode}-{label}-at-a-response-token", _changed(loss_mode, _set_token(name, value), with_mu),
          rf"{says} at 1 response tokens", InvalidBatchError)
    for loss_mode in LOSS_MODES
    for label, name, value, with_mu, says in (
        ("nan-log_prob", "log_prob", float("nan"), False, r"\(log_prob\) is NaN/inf"),
        ("-inf-mu", "old_log_prob", float("-inf"), False, r"\(old_log_prob = mu\) is NaN/inf"),
        ("nan-rollout_log_probs", "rollout_log_probs", float("nan"), True, r"\(rollout_log_probs = mu\) is NaN/inf"),
        ("+inf-advantages", "advantages", float("inf"), False, r"advantages are NaN/inf"),
    )
]


def _capped_and_finite(outcome):
    _finite(outcome)
    assert outcome[2]["zero_mismatch/is_log_ratio_capped_fraction"] > 0


HUGE_FINITE = [
    result(f"{loss_mode}-mu-of-1e-30-probability", _changed(loss_mode, _set_token("old_log_prob", -1e30)),
           _capped_and_finite, DOC)
    for loss_mode in LOSS_MODES
] + [
    result(f"{loss_mode}-log_prob-of--3e38", _changed(loss_mode, _set_token("log_prob", -3e38)), _finite, DOC)
    for loss_mode in LOSS_MODES
]

def _admit_every_row(loss_mode: str):
    return lambda: actor_config(loss_mode, trust_region_delta=1e9) if loss_mode == "flash_reinforce" else None


OVERFLOW = [
    error(f"{loss_mode}-advantages-of-{label}", _changed(
        loss_mode, lambda inputs, value=value, dtype=dtype: inputs.update(
            advantages=torch.where(inputs["mask"], torch.tensor(value, dtype=dtype), 0.0)),
        config=_admit_every_row(loss_mode)),
        "loss overflowed torch.float32 .* scale the rewards down", InvalidBatchError)
    for loss_mode in LOSS_MODES
    # 3e38 on a row of 5 tokens sums past fp32; 1e300 (float64) does not fit fp32 at all
    for label, value, dtype in (("3e38", 3e38, torch.float32), ("1e300-float64", 1e300, torch.float64))
]


# ----- masks, shapes, dtypes, settings ---------------------------------------------------------

def _mask_with(value: float):
    def change(inputs):
        mask = inputs["mask"].float()
        mask[1, 0] = value
        inputs["mask"] = mask
    return change


MASKS = [
    error(f"reinforce_zero-mask-holding-{value}", _changed("reinforce_zero", _mask_with(value)),
          "response_mask must hold only 0 and 1", InvalidBatchError)
    for value in (0.5, 2.0, -1.0, float("nan"))
] + [
    error("flash_reinforce-mask-as-numpy", _changed("flash_reinforce", lambda i: i.update(mask=i["mask"].numpy())),
          "response_mask must be a torch.Tensor", InvalidBatchError),
    error("reinforce_zero-mask-as-list", _changed("reinforce_zero", lambda i: i.update(mask=i["mask"].tolist())),
          "response_mask must be a torch.Tensor", InvalidBatchError),
]


def _numeric_and_bool_mask(loss_mode: str, dtype: torch.dtype):
    return lambda: (_changed(loss_mode, lambda i: i.update(mask=i["mask"].to(dtype)))(),
                    _changed(loss_mode, lambda _: None)())


MASKS += [
    result(f"{loss_mode}-0-1-mask-as-{str(dtype)[6:]}", _numeric_and_bool_mask(loss_mode, dtype), _bit_identical, DOC)
    for loss_mode in LOSS_MODES for dtype in (torch.float32, torch.int64)
]

SHAPES = [
    error(f"{loss_mode}-{label}", _changed(loss_mode, change), "every input must be \\(batch, response length\\)",
          InvalidBatchError)
    for loss_mode in LOSS_MODES
    for label, change in (
        ("1-D-inputs", lambda i: i.update({k: v[0] for k, v in i.items()})),
        ("3-D-inputs", lambda i: i.update({k: v[None] for k, v in i.items()})),
        ("advantages-per-row", lambda i: i.update(advantages=i["advantages"][:, 0])),
        ("mask-one-column-short", lambda i: i.update(mask=i["mask"][:, :-1])),
    )
] + [
    error("reinforce_zero-rollout_log_probs-one-row-short",
          _changed("reinforce_zero", lambda i: i.update(rollout_log_probs=i["rollout_log_probs"][:-1]), True),
          r"shape mismatch .* rollout_log_probs \(5, 7\)", InvalidBatchError),
]

DTYPES = [
    error("reinforce_zero-integer-log_prob", _changed("reinforce_zero", lambda i: i.update(
        log_prob=i["log_prob"].long())), r"\(log_prob\) must be a floating-point tensor, got torch.int64",
        InvalidBatchError),
    error("flash_reinforce-boolean-advantages", _changed("flash_reinforce", lambda i: i.update(
        advantages=i["advantages"] > 0)), "advantages must be a floating-point tensor", InvalidBatchError),
    error("reinforce_zero-numpy-old_log_prob", _changed("reinforce_zero", lambda i: i.update(
        old_log_prob=np.asarray(i["old_log_prob"]))), r"old_log_prob = mu\) must be a torch.Tensor",
        InvalidBatchError),
    error("flash_reinforce-missing-old_log_prob", _changed("flash_reinforce", lambda i: i.update(
        old_log_prob=None)), r"old_log_prob = mu\) must be a torch.Tensor .* got NoneType", InvalidBatchError),
]


def _policy_loss_with(**fields):
    def config():
        built = actor_config("flash_reinforce")
        for key, value in fields.items():
            object.__setattr__(built.policy_loss, key, value)  # as if changed after it was validated
        return built
    return config


SETTINGS = [
    error(f"flash_reinforce-trust_region_delta-{value}", _changed(
        "flash_reinforce", lambda _: None, config=_policy_loss_with(trust_region_delta=value)),
        "trust_region_delta must be a positive number", InvalidBatchError)
    for value in (float("nan"), 0.0, -0.01, "0.01")
] + [
    error("flash_reinforce-kl_direction-forward", _changed(
        "flash_reinforce", lambda _: None, config=_policy_loss_with(kl_direction="forward")),
        "kl_direction must be one of behaviour_to_learner, learner_to_behaviour", InvalidBatchError),
]


def _admitted_fraction_is_1(outcome):
    _finite(outcome)
    assert outcome[2]["flash_reinforce/admitted_fraction"] == 1.0, outcome[2]


SETTINGS += [
    result("flash_reinforce-trust_region_delta-inf", _changed(
        "flash_reinforce", _set_token("log_prob", -60.0), config=_policy_loss_with(trust_region_delta=math.inf)),
        _admitted_fraction_is_1, DOC),
]


def _global_batch_info(loss_mode: str, **info):
    def config():
        built = actor_config(loss_mode)
        built.global_batch_info.update(info)
        return built
    return config


SETTINGS += [
    error(f"{loss_mode}-global_batch_size-{size}", _changed(
        loss_mode, lambda _: None, config=_global_batch_info(loss_mode, dp_size=1, global_batch_size=size)),
        "global_batch_size .* is not a count of at least the 5 responses of this micro-batch", InvalidBatchError)
    for loss_mode in LOSS_MODES for size in (0, 4, float("nan"))
] + [
    error(f"{loss_mode}-dp_size-0", _changed(
        loss_mode, lambda _: None, config=_global_batch_info(loss_mode, dp_size=0, global_batch_size=8)),
        "dp_size 0 in verl's global batch info must be a number >= 1", InvalidBatchError)
    for loss_mode in LOSS_MODES
]


def _agg_mode(loss_mode: str, mode: str):
    def config():
        built = actor_config(loss_mode)
        object.__setattr__(built, "loss_agg_mode", mode)
        return built
    return config


def _with_is_weights(inputs):
    inputs["rollout_is_weights"] = torch.ones_like(inputs["log_prob"])


SETTINGS += [
    error(f"{loss_mode}-loss_agg_mode-{mode}", _changed(loss_mode, lambda _: None, config=_agg_mode(loss_mode, mode)),
          "set actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", InvalidBatchError)
    for loss_mode in LOSS_MODES for mode in ("token-mean", "seq-mean-token-sum")
] + [
    error(f"{loss_mode}-precomputed-rollout_is_weights{'+mu' if with_mu else ''}",
          _changed(loss_mode, _with_is_weights, with_mu),
          "would correct the same gap twice: set algorithm.rollout_correction.rollout_is=null", InvalidBatchError)
    for loss_mode in LOSS_MODES for with_mu in (False, True)
]


def _empty_with_mu(loss_mode: str):
    def run():
        pi, mu, old, advantages, mask = (t[:0] for t in padded_loss_batch())
        return pi.shape, loss_call(loss_mode, pi, old, advantages, mask, rollout_log_probs=mu)
    return run


EMPTY += [
    result(f"{loss_mode}-no-rows+mu", _empty_with_mu(loss_mode), _zero_loss_zero_gradient, DOC)
    for loss_mode in LOSS_MODES
]

# The framework-free formulas the losses are built from (zero_mismatch_plugin/algorithms/formulas.py).
FORMULAS = [
    error(f"formulas-sequence_mean_token_mean-num_sequences-{value}", lambda value=value: (
        formulas.sequence_mean_token_mean(torch.ones(2, 3), torch.ones(2, 3), num_sequences=value)),
        "num_sequences must be a positive count of responses", ValueError)
    for value in (0, -4, float("nan"))
] + [
    error("formulas-kl-direction-forward", lambda: formulas.sampled_action_bernoulli_kl(
        torch.full((2,), -1.0), torch.full((2,), -2.0), "forward"),
        "use 'behaviour_to_learner' or 'learner_to_behaviour'", ValueError),
    result("formulas-sequence_mean_token_mean-no-rows", lambda: formulas.sequence_mean_token_mean(
        torch.zeros(0, 3), torch.zeros(0, 3)), lambda value: _is_zero(value), DOC),
]


def _is_zero(value):
    assert value.item() == 0.0, value


# Shapes that torch would broadcast into a wrong number: every formula takes tensors of one shape.
_PI, _MU, _ADV = torch.full((3, 4), -1.0), torch.full((3, 4), -1.5), torch.tensor([1.0, -2.0, 0.5])
BROADCAST = "Broadcasting is refused"
FORMULAS += [
    error(f"formulas-{label}", run, says, ValueError)
    for label, run, says in (
        # (2, 3) values over a (2, 1) mask: 10.5, where a full mask gives 3.5
        ("sequence_mean_token_mean-mask-2x1-over-2x3", lambda: formulas.sequence_mean_token_mean(
            torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.ones(2, 1)),
         rf"sequence_mean_token_mean: mask has shape \(2, 1\), but values has \(2, 3\).*{BROADCAST}"),
        ("sequence_mean_token_mean-1-D", lambda: formulas.sequence_mean_token_mean(torch.ones(3), torch.ones(3)),
         r"sequence_mean_token_mean: values must be 2-D \(batch, response length\), got shape \(3,\)"),
        ("reinforce_zero_token_loss-mu-per-column", lambda: formulas.reinforce_zero_token_loss(
            _PI, _MU[0], _ADV), rf"behaviour_log_prob has shape \(4,\), but log_prob has \(3, 4\).*{BROADCAST}"),
        ("reinforce_zero_token_loss-one-advantage", lambda: formulas.reinforce_zero_token_loss(
            _PI, _MU, _ADV[:1]), r"advantages has shape \(1,\), but log_prob has \(3, 4\): pass one advantage "
         r"per row \(3,\) or per token \(3, 4\)"),
        ("reinforce_zero_token_loss-advantages-per-column", lambda: formulas.reinforce_zero_token_loss(
            _PI, _MU, torch.ones(4)), r"advantages has shape \(4,\), but log_prob has \(3, 4\)"),
        ("reinforce_zero_token_loss-1-D", lambda: formulas.reinforce_zero_token_loss(_PI[0], _MU[0], torch.ones(4)),
         r"reinforce_zero_token_loss: log_prob must be 2-D \(batch, response length\)"),
        ("flash_reinforce_token_loss-one-gate", lambda: formulas.flash_reinforce_token_loss(
            _PI, _MU, _ADV, torch.tensor([True])), r"admitted has shape \(1,\), but log_prob's rows has \(3,\)"),
        ("flash_reinforce_token_loss-float-gate", lambda: formulas.flash_reinforce_token_loss(
            _PI, _MU, _ADV, torch.ones(3)), r"admitted must be a bool tensor"),
        ("flash_reinforce_token_loss-mu-per-column", lambda: formulas.flash_reinforce_token_loss(
            _PI, _MU[0], _ADV, torch.ones(3, dtype=torch.bool)),
         r"flash_reinforce_token_loss: behaviour_log_prob has shape \(4,\)"),
        ("token_log_importance_ratio-mu-per-column", lambda: formulas.token_log_importance_ratio(_PI, _MU[0]),
         r"token_log_importance_ratio: behaviour_log_prob has shape \(4,\), but log_prob has \(3, 4\)"),
        ("bernoulli_kl-one-log_p", lambda: formulas.bernoulli_kl(_MU, torch.tensor([-1.0])),
         rf"bernoulli_kl: log_p has shape \(1,\), but log_q has \(3, 4\).*{BROADCAST}"),
        ("sequence_trust_region-mask-per-row", lambda: formulas.sequence_trust_region(
            torch.zeros(3, 4), torch.ones(3, 1), 0.01), r"sequence_trust_region: mask has shape \(3, 1\)"),
        ("masked-mask-per-row", lambda: formulas.masked(_PI, torch.ones(3, 1, dtype=torch.bool)),
         r"masked: mask has shape \(3, 1\), but values has \(3, 4\)"),
        ("effective_sample_size_fraction-mask-per-row", lambda: formulas.effective_sample_size_fraction(
            torch.tensor([[1.0, 3.0], [1.0, 1.0]]), torch.ones(2, 1)),
         r"effective_sample_size_fraction: mask has shape \(2, 1\)"),
    )
]

# Scalar arguments: real numbers in their range, never a bool, NaN or a string.
FORMULAS += [
    error(f"formulas-sequence_mean_token_mean-num_sequences-{label}", lambda value=value: (
        formulas.sequence_mean_token_mean(torch.ones(2, 3), torch.ones(2, 3), num_sequences=value)),
        "num_sequences must be a positive count of responses", ValueError)
    for label, value in (("True", True), ("inf", math.inf), ("2.5", 2.5), ("text-4", "4"))
] + [
    error(f"formulas-sequence_trust_region-delta-{label}", lambda value=value: formulas.sequence_trust_region(
        torch.zeros(2, 3), torch.ones(2, 3), value), r"delta must be a number >= 0", ValueError)
    for label, value in (("nan", math.nan), ("-0.01", -0.01), ("True", True), ("text-0.01", "0.01"))
] + [
    error(f"formulas-unclipped_importance_ratio-max_log_ratio-{label}", lambda value=value, dtype=dtype: (
        formulas.unclipped_importance_ratio(torch.tensor([[100.0, 0.0]], dtype=dtype), value)),
        rf"max_log_ratio must be a number > 0 and <= {bound}, so that e\^cap fits torch.{str(dtype)[6:]}",
        ValueError)
    for label, value, dtype, bound in (
        ("nan", math.nan, torch.float32, "88.72"), ("inf", math.inf, torch.float32, "88.72"),
        ("0", 0.0, torch.float32, "88.72"), ("50-for-float16", 50.0, torch.float16, "11.09"))
] + [
    error("formulas-log_ratio_cap-of-int64", lambda: formulas.log_ratio_cap(torch.int64),
          "gradient_dtype must be a floating-point torch.dtype", ValueError),
]


# The token metrics the losses report: the two logprobs and the mask have one shape.
def _metrics_call(name: str, log_prob, reference, mask):
    return lambda: getattr(token_metrics, name)(log_prob, reference, mask)


_SQUARE = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0], [-2.0, -0.2, -0.7]])
TOKEN_METRICS = [
    error(f"token_metrics-{name}-{label}", _metrics_call(name, _SQUARE, reference, mask),
          rf"{name}: {says}.*{BROADCAST}", ValueError)
    for name in ("importance_sampling_metrics", "log_prob_gap_metrics")
    for label, reference, mask, says in (
        # a (B,) mask would select whole rows of a (B, T) tensor
        ("mask-per-row", _SQUARE - 0.5, torch.tensor([True, True, False]), r"response_mask has shape \(3,\)"),
        ("reference-per-column", (_SQUARE - 0.5)[0], torch.ones(3, 3, dtype=torch.bool),
         r"(reference|behaviour)_log_prob has shape \(3,\), but log_prob has \(3, 3\)"),
    )
]


def _global_batch_info_error(loss_mode: str, says: str, **info):
    return error(f"{loss_mode}-{'-'.join(f'{k}-{v}' for k, v in info.items())}", _changed(
        loss_mode, lambda _: None, config=_global_batch_info(loss_mode, **info)), says, InvalidBatchError)


SETTINGS += [
    # an infinite count gives loss 0, a fractional one rescales every gradient
    _global_batch_info_error(loss_mode, "global_batch_size .* is not a count of at least the 5 responses",
                             dp_size=1, global_batch_size=size)
    for loss_mode in LOSS_MODES for size in (math.inf, 7.5)
] + [
    _global_batch_info_error(loss_mode, "dp_size .* must be a number >= 1 .*finite whole number",
                             dp_size=dp_size, global_batch_size=8)
    for loss_mode in LOSS_MODES for dp_size in (1.5, math.inf)
]

CASES = [*PADDING, *LOW_PRECISION, *MIXED, *EMPTY, *POSITIVE, *AT_TOLERANCE, *NON_FINITE, *HUGE_FINITE,
         *OVERFLOW, *MASKS, *SHAPES, *DTYPES, *SETTINGS, *FORMULAS, *TOKEN_METRICS]
