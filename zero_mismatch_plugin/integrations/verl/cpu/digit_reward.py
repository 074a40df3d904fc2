"""The CPU smoke run's reward in verl's ``custom_reward_function`` form: the digit reward
(:mod:`zero_mismatch_plugin.algorithms.digit_reward`) over the response's non-whitespace characters."""

from __future__ import annotations

from zero_mismatch_plugin.algorithms.digit_reward import digit_share


def compute_score(data_source, solution_str, ground_truth=None, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature: ``reward.custom_reward_function.name=compute_score``."""
    return digit_share([c for c in solution_str if not c.isspace()])
