"""NaN and infinities in what ``zmrl check`` / ``zmrl bisect`` compare: always a failure that says
"non-finite", never "equal", never blamed on repeatability, batching or the prefix cache.

No engine and no model: the compared values are planted directly (an op recorded through the
one recorder, a fake trainer backend, completions built by hand), so every test takes
milliseconds.
"""

from __future__ import annotations

import math

import torch

from zero_mismatch_plugin.tools.checker import checks, oplist
from zero_mismatch_plugin.tools.checker.bisect import compare_intermediates
from zero_mismatch_plugin.tools.checker.commands import format_bisect_table
from zero_mismatch_plugin.tools.checker.engine import Completion
from zero_mismatch_plugin.tools.checker.recording import OpRecorder

NAN, INF = float("nan"), float("inf")


# ----- one op ---------------------------------------------------------------------------------


def test_compare_op_fails_a_nan_even_when_both_sides_hold_it():
    a = torch.tensor([[1.0, NAN], [3.0, 2.0]])
    same_nan = oplist.compare_op("x", a, a.clone())
    assert not same_nan.equal
    assert same_nan.non_finite == {"engine": 1, "trainer": 1}
    assert same_nan.num_differing == 1 and same_nan.equal_fraction == 0.75
    assert same_nan.max_abs_diff == 0.0  # the finite values agree; the NaN is counted apart
    assert same_nan.problem == "non-finite values in op x (engine 1, trainer 1 of 4)"
    assert same_nan.as_dict()["non_finite"] == {"engine": 1, "trainer": 1}


def test_compare_op_fails_an_infinity_on_either_side_and_stays_quiet_when_finite():
    a = torch.tensor([[1.0, -INF], [3.0, 2.0]])
    for engine, trainer, counts in ((a, a.clone(), {"engine": 1, "trainer": 1}),
                                    (a.nan_to_num(neginf=0.0), a, {"engine": 0, "trainer": 1})):
        result = oplist.compare_op("x", engine, trainer)
        assert not result.equal and result.non_finite == counts
        assert math.isfinite(result.max_abs_diff)
    finite = torch.tensor([[1.0, 0.5]])
    clean = oplist.compare_op("x", finite, finite.clone())
    assert clean.equal and clean.non_finite is None and clean.problem == ""
    assert "non_finite" not in clean.as_dict()


def test_compare_op_counts_non_finite_values_in_pairs_and_with_a_shape_mismatch():
    q = torch.ones(3, 4)
    k = torch.ones(3, 2)
    k_nan = k.clone()
    k_nan[0, 0] = NAN
    pair = oplist.compare_op("layers.0.rotary", (q, k), (q.clone(), k_nan))
    assert not pair.equal and pair.non_finite == {"engine": 0, "trainer": 1}
    shapes = oplist.compare_op("x", torch.ones(2, 2), torch.full((3,), NAN))
    assert not shapes.equal and shapes.shape_mismatch and shapes.non_finite == {"engine": 0, "trainer": 3}


# ----- bisect: an op recorded with a NaN --------------------------------------------------------


def _record(names, perturb=None) -> dict:
    """A forward of a few ops through the recorder: each op adds one to the previous output."""
    with OpRecorder(perturb) as recorder:
        value = torch.arange(8, dtype=torch.float32).reshape(4, 2)
        for name in names:
            value = recorder.keep(name, value + 1)
    return recorder.ops


ORDER = ["embed", "layers.0.input_norm", "layers.0.qkv_proj", "layers.0.attn", "final_norm", "logits"]


def _plant_nan(planted):
    def perturb(name, value):
        if name != planted:
            return value
        out = value.clone()
        out[0, 0] = NAN
        return out

    return perturb


def test_bisect_names_the_op_a_nan_was_planted_in_never_no_difference():
    engine = _record(ORDER)
    trainer = _record(ORDER, _plant_nan("layers.0.qkv_proj"))
    result = compare_intermediates(ORDER, engine, trainer)
    assert result.first_differing_op == "layers.0.qkv_proj"
    assert [op.equal for op in result.ops] == [True, True, False, False, False, False]
    assert result.first.non_finite == {"engine": 0, "trainer": 1}
    report = result.as_dict()
    assert report["pass"] is False and report["problem"].startswith("non-finite values in op layers.0.qkv_proj")
    table = format_bisect_table(result, "header")
    assert "first differing op: layers.0.qkv_proj  non-finite values in op layers.0.qkv_proj" in table
    assert "no difference" not in table and "NaN/inf" in table


def test_bisect_fails_on_nan_both_sides_computed_alike():
    """A NaN in the checkpoint (e.g. its norm epsilon) makes both sides NaN in the same places
    from some op on: that op is named, not "all ops bitwise equal"."""
    both = _plant_nan("layers.0.input_norm")
    result = compare_intermediates(ORDER, _record(ORDER, both), _record(ORDER, both))
    assert result.first_differing_op == "layers.0.input_norm"
    assert result.first.non_finite == {"engine": 1, "trainer": 1}
    assert "no difference" not in format_bisect_table(result, "header")


# ----- check: logprobs with a NaN --------------------------------------------------------------


class _Backend:
    """A trainer backend answering with fixed logprobs (the same bits on every call)."""

    name = "fake"

    def __init__(self, token_logprobs, full=None):
        self._tokens = token_logprobs
        self._full = full

    def token_logprobs(self, batch):
        return self._tokens.clone()

    def full_logprobs(self, batch):
        return self._full.clone()


def _completions(logprobs):
    return [Completion(prompt=[1, 2], tokens=[3, 4, 5], logprobs=list(logprobs),
                       distributions=[{3: logprobs[0]}, {4: logprobs[1]}, {5: logprobs[2]}])]


def test_sampled_token_check_reports_non_finite_logprobs_not_an_unrepeatable_trainer():
    engine = [-1.5, -0.25, -2.0]
    trainer = torch.tensor([-1.5, NAN, -2.0])
    result = checks.sampled_token_check(_Backend(trainer), _completions(engine))
    assert result.passed is False
    assert result.figures["trainer_repeatable"] is True  # the same NaN bits on every call
    assert result.figures["non_finite"] == {"trainer": 1, "engine": 0}
    assert result.summary.startswith("non-finite logprobs (trainer 1, engine 0)")
    assert "NOT repeatable" not in result.summary
    assert all(math.isfinite(result.figures[k]) for k in ("max_abs_diff", "mean_abs_diff", "mean_k3"))


def test_sampled_token_check_fails_nan_on_both_sides():
    result = checks.sampled_token_check(_Backend(torch.tensor([NAN, -0.25, -2.0])), _completions([NAN, -0.25, -2.0]))
    assert result.passed is False and result.figures["non_finite"] == {"trainer": 1, "engine": 1}
    assert result.figures["bitwise_equal_fraction"] < 1.0


def test_full_distribution_check_fails_an_infinite_logprob_on_both_sides():
    full = torch.full((3, 8), -2.0)
    full[1, 4] = -INF
    result = checks.full_distribution_check(_Backend(None, full), _completions([-2.0, -INF, -2.0]), False, 8)
    assert result.passed is False
    assert result.figures["non_finite"] == {"trainer": 1, "engine": 1}
    assert result.figures["positions_all_equal_fraction"] == 2 / 3
    assert result.summary.startswith("non-finite logprobs")


def test_engine_self_comparisons_name_non_finite_logprobs_not_batching_or_the_cache():
    reference = _completions([-1.0, NAN, -3.0])[0]
    other = _completions([-1.0, NAN, -3.0])[0]
    compared = checks._compare_completions(reference, other)
    assert compared["identical"] is False and compared["non_finite"] == 2 and compared["tokens_identical"]
    assert math.isfinite(compared["max_abs_diff"])


def test_prefill_vs_decode_check_reports_non_finite_engine_logprobs(monkeypatch):
    completions = _completions([-1.0, -2.0, -3.0])
    monkeypatch.setattr(checks.eng, "rescore", lambda llm, c: [[-1.0, NAN, -3.0]])

    class Engine:
        lora_request = None

    result = checks.prefill_vs_decode_check(Engine(), completions)
    assert result.passed is False and result.figures["non_finite"] == {"prefill": 1, "decode": 0}
    assert result.summary.startswith("non-finite engine logprobs (prefill 1, decode 0)")


def test_expert_selection_check_fails_choices_made_from_nan_router_logits():
    """The same experts chosen on both sides from NaN logits agree by accident: not a pass."""
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    router = torch.full((3, 4), NAN)

    class Modules:
        def forward(self, batch, record):
            record.update({"layers.0.router": router, "layers.0.topk_ids": ids})

    class Backend:
        name = "fake"

        def intermediates(self, batch):
            return {"layers.0.router": router.clone(), "layers.0.topk_ids": ids.clone()}

    result = checks.expert_selection_check(Backend(), _completions([-1.0, -2.0, -3.0]), Modules())
    assert result.figures["min_agreement"] == 1.0
    assert result.passed is False and result.figures["non_finite_router_logits"] == {"0": {"engine": 12, "trainer": 12}}
    assert result.summary.startswith("non-finite router logits in layers 0")
