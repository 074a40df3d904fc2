"""Run-level statistics over per-update metric values.

Plain functions over sequences of floats: no I/O, no numpy, no plotting, so each one can be
checked by hand against a short list.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence


def median(values: Sequence[float]) -> float:
    """Median; the mean of the two middle values for an even count."""
    if not values:
        raise ValueError("median of an empty sequence")
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of an empty sequence")
    return math.fsum(values) / len(values)


def quantile(values: Sequence[float], q: float) -> float:
    """Quantile with linear interpolation between order statistics (numpy's default rule)."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level must lie in [0, 1], got {q}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    fraction = position - below
    return ordered[below] + (ordered[above] - ordered[below]) * fraction


def safe_ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator`` for the non-negative quantities compared here, else None.

    A ratio of a non-positive denominator (a median of exactly 0, as bit-exact synchronous
    training gives, or a slightly negative k1 KL) or of a negative numerator has no meaning
    as "how many times larger", so it is reported as undefined rather than as a number.
    """
    if denominator <= 0 or numerator < 0:
        return None
    return numerator / denominator


def peak_to_median(values: Sequence[float]) -> float | None:
    """max / median: how far the worst update stands above a typical one."""
    return safe_ratio(max(values), median(values))


def effective_window(series_length: int, requested: int) -> int:
    """Window actually used for "first N" and "last N" updates.

    The requested window is kept when the series holds at least two windows. Shorter runs
    shrink it to half the series (rounded down) so the first and last windows never share an
    update; a one-value series uses that value for both.
    """
    if requested < 1:
        raise ValueError(f"window must be at least 1, got {requested}")
    if series_length < 1:
        raise ValueError("window of an empty series")
    return min(requested, max(1, series_length // 2))


def first_and_last_window(values: Sequence[float], requested: int) -> tuple[Sequence[float], Sequence[float], int]:
    """The first and last ``effective_window`` values, and that window size."""
    window = effective_window(len(values), requested)
    return values[:window], values[len(values) - window :], window


def integer_counts(values: Sequence[float]) -> dict[int, int] | None:
    """How many times each value occurs, when every value is a whole number (a lag in versions)."""
    if any(not float(v).is_integer() for v in values):
        return None
    return dict(sorted(Counter(int(v) for v in values).items()))
