"""Zero-mismatch mode refuses sampling settings under which μ cannot be reproduced."""

import warnings

import pytest
import torch

from zero_mismatch_plugin.aligned import SamplingTransform, ZeroMismatchViolation


def test_raw_logprobs_with_temperature_is_refused():
    with pytest.raises(ZeroMismatchViolation, match="raw_logprobs"):
        SamplingTransform(temperature=0.7, logprobs_mode="raw_logprobs").check()


def test_raw_logprobs_with_truncation_is_refused():
    with pytest.raises(ZeroMismatchViolation):
        SamplingTransform(top_p=0.9, logprobs_mode="raw_logprobs").check()
    with pytest.raises(ZeroMismatchViolation):
        SamplingTransform(top_k=5, logprobs_mode="raw_logprobs").check()


def test_truncation_without_mask_replay_is_refused():
    with pytest.raises(ZeroMismatchViolation, match="mask"):
        SamplingTransform(top_k=5, replay_mask=False).check()


def test_greedy_is_refused():
    with pytest.raises(ZeroMismatchViolation, match="greedy"):
        SamplingTransform(temperature=0.0).check()


def test_non_strict_mode_warns_loudly():
    with pytest.warns(UserWarning, match="zero mismatch is not possible"):
        SamplingTransform(temperature=0.5, logprobs_mode="raw_logprobs").check(strict=False)


ALLOWED = [
    SamplingTransform(),
    SamplingTransform(logprobs_mode="raw_logprobs"),
    SamplingTransform(temperature=0.7, top_k=5, top_p=0.8),
    SamplingTransform(top_k=-1, top_p=1.0),  # -1: top-k off, as vLLM spells it
]


@pytest.mark.parametrize("transform", ALLOWED, ids=repr)
def test_allowed_settings_have_no_problem_and_pass_silently(transform, caplog):
    assert transform.problems() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here would be a false alarm
        assert transform.check() is None
        assert transform.check(strict=False) is None
    assert not caplog.records


def test_unreplayed_logits_processors_are_refused():
    from vllm import SamplingParams

    with pytest.raises(ZeroMismatchViolation, match="repetition_penalty"):
        SamplingTransform.from_sampling_params(SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ZeroMismatchViolation, match="min_tokens"):
        SamplingTransform.from_sampling_params(SamplingParams(min_tokens=4, max_tokens=8))
    t = SamplingTransform.from_sampling_params(SamplingParams(temperature=0.8, top_k=7, top_p=0.95))
    assert (t.temperature, t.top_k, t.top_p) == (0.8, 7, 0.95)


def test_mask_is_vllms_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    mask = SamplingTransform(top_k=2).engine_mask(logits)
    assert mask.tolist() == [[True, False, True, False, True]]


@pytest.mark.parametrize("per_row", [False, True])
def test_the_one_logprob_tail_is_vllms_sampler(per_row):
    """Temperature, compute_logprobs and gather, with a float or a per-row temperature, equal
    vLLM's ``apply_temperature`` + ``compute_logprobs`` bit for bit (and T = 1 skips the division)."""
    from vllm.v1.sample.sampler import Sampler

    from zero_mismatch_plugin.aligned.sampling import recorded_logprobs, vllm_label_logprobs

    g = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(6, 50, generator=g)
    labels = torch.randint(0, 50, (6,), generator=g)
    temps = torch.full((6,), 0.7)
    expected = Sampler.compute_logprobs(Sampler.apply_temperature(logits.clone(), temps, all_random=True))
    expected = expected.gather(-1, labels[:, None])[:, 0]
    got = vllm_label_logprobs(logits, labels, temps if per_row else 0.7)
    assert torch.equal(got, expected)
    assert torch.equal(recorded_logprobs(logits, labels, SamplingTransform(temperature=0.7)), expected)
    plain = Sampler.compute_logprobs(logits).gather(-1, labels[:, None])[:, 0]
    assert torch.equal(recorded_logprobs(logits, labels), plain)
    assert not torch.equal(plain, expected)  # the temperature is applied, not dropped
