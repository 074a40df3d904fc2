"""Llama and Qwen3 shapes (Qwen3: q/k norm, tied embeddings): engine μ vs the aligned trainer,
negative control, backward, sampling transform, weight sync.

The family is a module-scoped parameter, so pytest runs every test of one family before the
next and each engine starts once. Within a family the weight-sync test goes last because it
changes the weights of both sides (together).
"""

from support import aligned_checks as checks
import pytest


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.quick), "qwen3"])
def family(request):
    return request.param


def test_trainer_logprobs_bitwise_equal_engine(engines, trainers, family):
    checks.check_bitwise_equal(engines, trainers, family)


def test_hf_transformers_forward_is_close_and_told_apart(engines, trainers, family):
    equal, max_diff = checks.check_hf_forward_is_close_and_comparison_discriminates(engines, trainers, family)
    print(f"{family}: transformers fp32 forward {equal:.1%} bitwise equal on this host, max |diff| {max_diff:.3g}")


def test_custom_backward_matches_float64_autograd(engines, trainers, family):
    worst = checks.check_backward_matches_float64(trainers(family), engines, family)
    print(f"{family}: worst relative gradient error vs float64 {worst:.3g}")


def test_temperature_and_top_k_top_p_replayed(engines, trainers, family):
    checks.check_sampling_transform(engines, trainers, family)


def test_equal_again_after_optimizer_step_and_weight_sync(engines, trainers, family):
    checks.check_update_and_sync(engines, trainers, family)
