"""Rule reward of the CPU smoke run, in verl's ``custom_reward_function`` form.

The demo's task ("answer with digits") scores a response by its share of digit tokens. verl hands
a custom reward the decoded response text, so the same idea is scored on characters: the
fraction of the response's non-space characters that are digits, in [0, 1].
"""

from __future__ import annotations


def digit_fraction(text: str) -> float:
    """Share of non-whitespace characters of ``text`` that are ASCII digits (0.0 for none)."""
    visible = [c for c in text if not c.isspace()]
    if not visible:
        return 0.0
    return sum(c in "0123456789" for c in visible) / len(visible)


def compute_score(data_source, solution_str, ground_truth=None, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature: ``reward.custom_reward_function.name=compute_score``."""
    return digit_fraction(solution_str)
