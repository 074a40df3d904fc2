"""Mistral shape (no sliding window, untied head): engine μ vs the aligned trainer, backward,
weight sync. Mistral is supported by one entry in zero_mismatch_plugin.tables.architectures.

The weight-sync test goes last because it changes the weights of both sides (together).
"""

from support import aligned_checks as checks

NAME = "mistral"


def test_trainer_logprobs_bitwise_equal_engine(engines, trainers):
    checks.check_bitwise_equal(engines, trainers, NAME)


def test_custom_backward_matches_float64_autograd(engines, trainers):
    worst = checks.check_backward_matches_float64(trainers(NAME), engines, NAME)
    print(f"{NAME}: worst relative gradient error vs float64 {worst:.3g}")


def test_equal_again_after_optimizer_step_and_weight_sync(engines, trainers):
    checks.check_update_and_sync(engines, trainers, NAME)
