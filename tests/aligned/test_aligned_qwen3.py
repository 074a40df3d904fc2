"""Qwen3 shape (q/k norm, tied embeddings): engine μ vs the aligned trainer, negative control, backward, weight sync.

Order matters only for speed: all tests use the same live engine; the weight-sync test goes last
because it changes the weights of both sides (together).
"""

import aligned_checks as checks

NAME = "qwen3"


def test_trainer_logprobs_bitwise_equal_engine(engines, trainers):
    checks.check_bitwise_equal(engines, trainers, NAME)


def test_hf_transformers_forward_is_close_and_told_apart(engines, trainers):
    equal, max_diff = checks.check_hf_forward_is_close_and_comparison_discriminates(engines, trainers, NAME)
    print(f"{NAME}: transformers fp32 forward {equal:.1%} bitwise equal on this host, max |diff| {max_diff:.3g}")


def test_custom_backward_matches_float64_autograd(engines, trainers):
    worst = checks.check_backward_matches_float64(trainers(NAME), engines, NAME)
    print(f"{NAME}: worst relative gradient error vs float64 {worst:.3g}")


def test_equal_again_after_optimizer_step_and_weight_sync(engines, trainers):
    checks.check_update_and_sync(engines, trainers, NAME)
