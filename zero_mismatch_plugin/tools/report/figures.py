"""Which metric keys feed each diagnostic, and the run-level figures computed from them.

Each quantity reads the first of its candidate keys the run logged (the plugin's ``actor/`` metrics,
the same without the prefix, verl's standard names); later candidates also logged are listed,
never mixed in. See docs/diagnostics.md, "The figures".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from zero_mismatch_plugin.tools.report import stats
from zero_mismatch_plugin.tools.report.logs import RunLog

DEFAULT_WINDOW = 1000
OK = "ok"
MISSING = "missing"
NO_FINITE_VALUES = "no finite values"
NOT_A_NUMBER = "not a number"


@dataclass(frozen=True)
class MetricSource:
    """A logged key, read as is or as ``1 - value`` (a rejected fraction from an admitted one)."""

    key: str
    complement: bool = False

    def describe(self) -> str:
        return f"1 - {self.key}" if self.complement else self.key

    def read(self, value: float) -> float:
        return 1.0 - value if self.complement else value


def _with_and_without_actor_prefix(*names: str) -> tuple[MetricSource, ...]:
    return tuple(MetricSource(f"actor/{name}") for name in names) + tuple(MetricSource(name) for name in names)


# Per-update D3 = mean over response tokens of w - 1 - log w (verl's k3 estimator). The
# actor-side value is computed by the loss against the weights being updated; the
# driver-side `rollout_corr/k3_kl` (verl's decoupled mode) against the recomputed old policy.
D3_SOURCES = _with_and_without_actor_prefix("rollout_corr/k3_kl")
# Rollout-to-learner KL, k1 estimator mean(log mu - log pi).
KL_SOURCES = _with_and_without_actor_prefix("rollout_corr/kl")
# verl's engines log the total norm returned by clip_grad_norm_, i.e. before clipping.
GRAD_NORM_SOURCES = (MetricSource("actor/grad_norm"), MetricSource("grad_norm"))
# Fraction of sequences a gate rejected: verl's sequence-level rejection-sampling metric (the
# plugin's FlashREINFORCE logs the same name), else the complement of FlashREINFORCE's
# admitted fraction.
REJECTION_SOURCES = _with_and_without_actor_prefix("rollout_corr/rollout_rs_seq_masked_fraction") + (
    MetricSource("actor/flash_reinforce/admitted_fraction", complement=True),
    MetricSource("flash_reinforce/admitted_fraction", complement=True),
)
# Preferred: the fraction over tokens scored with the weights that sampled them (what
# `zmrl demo` logs), which isolates kernel mismatch at any lag. The loss's own metric compares
# with the current weights, so at lag > 0 it also counts weight lag.
BITWISE_EQUAL_SOURCES = (MetricSource("demo/own_version/bitwise_equal_fraction"),) + _with_and_without_actor_prefix(
    "zero_mismatch/bitwise_equal_fraction")
REWARD_SOURCES = (MetricSource("critic/score/mean"), MetricSource("critic/rewards/mean"))
# verl's V1 trainer: versions between a trajectory's freshest sampling weights and the weights
# being trained (`trajectory_staleness`) and its oldest ones (`trajectory_staleness_worst`).
def _off_policy_sources(name: str) -> tuple[MetricSource, ...]:
    """verl's off-policy metric ``name``, under the trainer's ``training/`` prefix and without it."""
    return (MetricSource(f"training/off_policy/{name}"), MetricSource(f"off_policy/{name}"))


LAG_MEAN_SOURCES = _off_policy_sources("trajectory_staleness/mean")
LAG_MAX_SOURCES = _off_policy_sources("trajectory_staleness/max")
LAG_WORST_MAX_SOURCES = _off_policy_sources("trajectory_staleness_worst/max")
LAG_SPANS_MAX_SOURCES = _off_policy_sources("trajectory_spans/max")

SOURCES_BY_QUANTITY = {
    "d3": D3_SOURCES,
    "kl": KL_SOURCES,
    "grad_norm": GRAD_NORM_SOURCES,
    "rejection": REJECTION_SOURCES,
    "bitwise_equal": BITWISE_EQUAL_SOURCES,
    "lag": LAG_MEAN_SOURCES + LAG_MAX_SOURCES + LAG_WORST_MAX_SOURCES + LAG_SPANS_MAX_SOURCES,
    "reward": REWARD_SOURCES,
}


NON_FINITE_KINDS = ("null", "NaN", "inf", "-inf")
STEPS_NAMED = 5  # steps listed per kind of non-finite value in a note


@dataclass
class Series:
    """The finite values of one source, in step order, and the steps of the values that were not.

    ``non_finite_steps`` maps ``null`` / ``NaN`` / ``inf`` / ``-inf`` to the steps that logged
    one (after ``1 - value`` for a complement source); ``problems`` are notes on values of the
    candidate keys that are not numbers or were logged twice at one step.
    """

    source: MetricSource
    steps: list[int]
    values: list[float]
    non_finite: int
    also_present: list[str]
    non_finite_steps: dict[str, list[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def highest(self) -> tuple[float, int] | None:
        """(largest value, its first step), +inf where one was logged; None without any."""
        if self.non_finite_steps.get("inf"):
            return math.inf, self.non_finite_steps["inf"][0]
        if not self.values:
            return None
        index = max(range(len(self.values)), key=self.values.__getitem__)
        return self.values[index], self.steps[index]

    def lowest(self) -> tuple[float, int] | None:
        """(smallest value, its first step), -inf where one was logged; None without any."""
        if self.non_finite_steps.get("-inf"):
            return -math.inf, self.non_finite_steps["-inf"][0]
        if not self.values:
            return None
        index = min(range(len(self.values)), key=self.values.__getitem__)
        return self.values[index], self.steps[index]

    def non_finite_counts(self) -> dict[str, int]:
        return {kind: len(self.non_finite_steps[kind]) for kind in NON_FINITE_KINDS if self.non_finite_steps.get(kind)}

    def non_finite_note(self) -> list[str]:
        if not self.non_finite:
            return []
        parts = []
        for kind in NON_FINITE_KINDS:
            steps = self.non_finite_steps.get(kind, [])
            if steps:
                named = ", ".join(str(step) for step in steps[:STEPS_NAMED])
                more = f" and {len(steps) - STEPS_NAMED} more" if len(steps) > STEPS_NAMED else ""
                parts.append(f"{kind} at step{'s' if len(steps) > 1 else ''} {named}{more}")
        return [f"{self.non_finite} update(s) logged a non-finite value ({'; '.join(parts)}): counted, "
                "left out of medians and means; an infinite value is the max/min where one occurs"]


def _value_problems(run: RunLog, key: str) -> list[str]:
    notes = []
    if key in run.not_numbers:
        found = run.not_numbers[key]
        notes.append(f"{key} is present but not a number on {found.count} line(s), left out: {found.describe()}")
    if key in run.conflicts:
        found = run.conflicts[key]
        notes.append(f"{key} is logged twice at one step with different values on {found.count} line(s), the "
                     f"later value used: {found.describe()}")
    return notes


def select_series(run: RunLog, sources: Sequence[MetricSource]) -> Series | None:
    """The first source the run logged as a number (or null), or None when it logged none of them."""
    logged = [source for source in sources if run.has(source.key)]
    if not logged:
        return None
    chosen = logged[0]
    steps: list[int] = []
    values: list[float] = []
    non_finite_steps: dict[str, list[int]] = {}
    for step, value in run.series(chosen.key):
        if value is not None:
            value = chosen.read(value)
        if value is None or not math.isfinite(value):
            kind = "null" if value is None else "NaN" if math.isnan(value) else "inf" if value > 0 else "-inf"
            non_finite_steps.setdefault(kind, []).append(step)
        else:
            steps.append(step)
            values.append(value)
    problems = _value_problems(run, chosen.key)
    for source in sources:
        if source is not chosen and source.key in run.not_numbers:
            problems += _value_problems(run, source.key)[:1]
    return Series(chosen, steps, values, sum(map(len, non_finite_steps.values())),
                  [s.describe() for s in logged[1:]], non_finite_steps, problems)


def _not_numbers(run: RunLog, sources: Sequence[MetricSource]) -> list[str]:
    """Notes on candidate keys the run logged, but never as a number."""
    return [note for source in sources if source.key in run.not_numbers
            for note in _value_problems(run, source.key)[:1]]


def _missing(run: RunLog, sources: Sequence[MetricSource], **figures: None) -> dict:
    not_numbers = _not_numbers(run, sources)
    status = NOT_A_NUMBER if not_numbers else MISSING
    return {"status": status, "looked_for": [s.describe() for s in sources], **figures, "notes": not_numbers}


def _header(series: Series) -> dict:
    status = OK if series.values else NO_FINITE_VALUES
    return {
        "status": status,
        "source": series.source.describe(),
        "also_present": series.also_present,
        "updates": len(series.values),
        "non_finite": series.non_finite,
        "non_finite_counts": series.non_finite_counts(),
    }


def _notes(series: Series, *more: str) -> list[str]:
    return [*series.non_finite_note(), *series.problems, *more]


def _windowed(
    series: Series, window: int, aggregate: Callable[[Sequence[float]], float], stem: str
) -> dict:
    """First/last-window aggregates, with the steps each window covers."""
    first, last, used = stats.first_and_last_window(series.values, window)
    first_steps = series.steps[:used]
    last_steps = series.steps[len(series.steps) - used :]
    notes = []
    if used < window:
        notes.append(f"window shrunk from {window} to {used} updates: the run logged {len(series.values)}")
    if len(series.values) == 1:
        notes.append("one update only: the first and last windows are the same update")
    return {
        "window": used,
        f"first_window{stem}": aggregate(first),
        f"last_window{stem}": aggregate(last),
        "first_window_steps": [first_steps[0], first_steps[-1]],
        "last_window_steps": [last_steps[0], last_steps[-1]],
        "notes": notes,
    }


def _read(run: RunLog, sources: Sequence[MetricSource], **empty: None) -> tuple[Series | None, dict]:
    """(series, figures) of the first of ``sources`` the run logged: the header, ``empty``'s keys
    set to None and the notes, for the caller to complete. Without a source the series is None
    and the figures are final."""
    series = select_series(run, sources)
    if series is None:
        return None, _missing(run, sources, **empty)
    return series, {**_header(series), **empty, "notes": _notes(series)}


def d3_figures(run: RunLog) -> dict:
    series, result = _read(run, D3_SOURCES, median=None, peak=None, peak_step=None, peak_to_median=None)
    if series is None:
        return result
    high = series.highest()
    if high is not None:
        result["peak"], result["peak_step"] = high
    if series.values:
        median = result["median"] = stats.median(series.values)
        result["peak_to_median"] = stats.safe_ratio(result["peak"], median)
        if result["peak_to_median"] is None:
            result["notes"].append(f"peak/median undefined: the median D3 is {median!r}")
    return result


def kl_figures(run: RunLog, window: int) -> dict:
    series, result = _read(run, KL_SOURCES, window=None, first_window_median=None, last_window_median=None,
                           last_over_first=None, median=None)
    if series is None or not series.values:
        return result
    windows = _windowed(series, window, stats.median, "_median")
    ratio = stats.safe_ratio(windows["last_window_median"], windows["first_window_median"])
    if ratio is None:
        windows["notes"].append(
            "last/first undefined: the window medians are "
            f"{windows['first_window_median']!r} and {windows['last_window_median']!r} (k1 KL can be <= 0)"
        )
    return {**result, **windows, "notes": result["notes"] + windows["notes"], "last_over_first": ratio,
            "median": stats.median(series.values)}


def grad_norm_figures(run: RunLog) -> dict:
    series, result = _read(run, GRAD_NORM_SOURCES, max=None, max_step=None, median=None)
    if series is None:
        return result
    if series.non_finite:
        result["notes"].append("a non-finite grad norm makes verl skip that optimizer step")
    high = series.highest()
    if high is not None:
        result["max"], result["max_step"] = high
    if series.values:
        result["median"] = stats.median(series.values)
    return result


def rejection_figures(run: RunLog, window: int) -> dict:
    series, result = _read(run, REJECTION_SOURCES, window=None, first_window=None, last_window=None, mean=None,
                           max=None)
    if series is None:
        return result
    high = series.highest()
    result["max"] = None if high is None else high[0]
    if not series.values:
        return result
    windows = _windowed(series, window, stats.mean, "")
    return {**result, **windows, "notes": result["notes"] + windows["notes"], "mean": stats.mean(series.values)}


def bitwise_equal_figures(run: RunLog) -> dict:
    series, result = _read(run, BITWISE_EQUAL_SOURCES, min=None, min_step=None, updates_fully_equal=None)
    if series is None:
        return result
    low = series.lowest()
    if low is not None:
        result["min"], result["min_step"] = low
    if series.values:
        result["updates_fully_equal"] = sum(1 for value in series.values if value == 1.0)
    return result


def _highest_value(series: Series | None) -> float | None:
    high = None if series is None else series.highest()
    return None if high is None else high[0]


def lag_figures(run: RunLog) -> dict:
    mean_series = select_series(run, LAG_MEAN_SOURCES)
    max_series = select_series(run, LAG_MAX_SOURCES)
    worst_series = select_series(run, LAG_WORST_MAX_SOURCES)
    spans_series = select_series(run, LAG_SPANS_MAX_SOURCES)
    result: dict = {
        "mean_per_update": None,
        "max_per_update": None,
        "worst_case_max": _highest_value(worst_series),
        "spans_max": _highest_value(spans_series),
    }
    found = {
        name: series
        for name, series in (
            ("mean_per_update", mean_series),
            ("max_per_update", max_series),
            ("worst_case_max", worst_series),
            ("spans_max", spans_series),
        )
        if series is not None
    }
    if not found:
        return {**_missing(run, SOURCES_BY_QUANTITY["lag"]), **result}
    if mean_series is not None and mean_series.values:
        values = mean_series.values
        result["mean_per_update"] = {
            "median": stats.median(values),
            "p90": stats.quantile(values, 0.9),
            "max": _highest_value(mean_series),
        }
    if max_series is not None and max_series.values:
        # Lags are whole versions, so the per-update maxima form a small histogram.
        result["max_per_update"] = {
            "max": _highest_value(max_series),
            "median": stats.median(max_series.values),
            "counts": stats.integer_counts(max_series.values),
        }
    any_values = any(series.values for series in found.values())
    notes = []
    for name, series in found.items():
        notes += [f"{name}: {note}" for note in _notes(series)]
    return {
        "status": OK if any_values else NO_FINITE_VALUES,
        "source": {name: series.source.describe() for name, series in found.items()},
        "updates": max(len(series.values) for series in found.values()),
        "non_finite": max(series.non_finite for series in found.values()),
        **result,
        "notes": notes,
    }


def reward_figures(run: RunLog, window: int) -> dict:
    series, result = _read(run, REWARD_SOURCES, window=None, first_window=None, last_window=None)
    if series is None or not series.values:
        return result
    windows = _windowed(series, window, stats.mean, "")
    return {**result, **windows, "notes": result["notes"] + windows["notes"]}


def run_figures(run: RunLog, window: int = DEFAULT_WINDOW) -> dict:
    """All diagnostics of one run, as JSON-ready nested dicts."""
    steps = run.steps
    return {
        "path": str(run.path),
        "lines": list(run.lines) if run.lines else None,
        "segment": None if run.segment is None else {"index": run.segment[0], "of": run.segment[1]},
        "format": sorted(run.formats),
        "steps_logged": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "d3": d3_figures(run),
        "kl": kl_figures(run, window),
        "grad_norm": grad_norm_figures(run),
        "rejection": rejection_figures(run, window),
        "bitwise_equal": bitwise_equal_figures(run),
        "lag": lag_figures(run),
        "reward": reward_figures(run, window),
    }


def build_report(runs: Sequence[RunLog], window: int = DEFAULT_WINDOW) -> dict:
    """The whole report: the requested window and one entry per run, keyed by its label."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    return {
        "window_requested": window,
        "warnings": [warning for run in runs for warning in run.warnings],
        "runs": {run.label: run_figures(run, window) for run in runs},
    }
