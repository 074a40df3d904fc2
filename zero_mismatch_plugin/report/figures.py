"""Which metric keys feed each diagnostic, and the run-level figures computed from them.

Each quantity has an ordered list of candidate keys: the plugin's own metrics as verl logs
them (``actor/`` prefix), the same names without the prefix (verl's driver-side
rollout-correction metrics, or a plain JSONL log), and verl's standard names. The first
candidate the run logged is used and named in the report; later candidates that were also
logged are listed, never mixed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from zero_mismatch_plugin.report import stats
from zero_mismatch_plugin.report.logs import RunLog

DEFAULT_WINDOW = 1000
OK = "ok"
MISSING = "missing"
NO_FINITE_VALUES = "no finite values"


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


@dataclass
class Series:
    """The finite values of one source, in step order, and how many logged values were not finite."""

    source: MetricSource
    steps: list[int]
    values: list[float]
    non_finite: int
    also_present: list[str]


def select_series(run: RunLog, sources: Sequence[MetricSource]) -> Series | None:
    """The first source the run logged, or None when it logged none of them."""
    logged = [source for source in sources if run.has(source.key)]
    if not logged:
        return None
    chosen = logged[0]
    steps: list[int] = []
    values: list[float] = []
    non_finite = 0
    for step, value in run.series(chosen.key):
        if value is None:
            non_finite += 1
        else:
            steps.append(step)
            values.append(chosen.read(value))
    return Series(chosen, steps, values, non_finite, [s.describe() for s in logged[1:]])


def _missing(sources: Sequence[MetricSource], **figures: None) -> dict:
    return {"status": MISSING, "looked_for": [s.describe() for s in sources], **figures, "notes": []}


def _header(series: Series) -> dict:
    status = OK if series.values else NO_FINITE_VALUES
    return {
        "status": status,
        "source": series.source.describe(),
        "also_present": series.also_present,
        "updates": len(series.values),
        "non_finite": series.non_finite,
    }


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
    """(series, figures) of the first of ``sources`` the run logged. Without a source or a finite
    value the series is None and the figures are final (``empty``'s keys set to None); otherwise
    they are the header for the caller to complete."""
    series = select_series(run, sources)
    if series is None:
        return None, _missing(sources, **empty)
    if not series.values:
        return None, {**_header(series), **empty, "notes": []}
    return series, _header(series)


def d3_figures(run: RunLog) -> dict:
    series, result = _read(run, D3_SOURCES, median=None, peak=None, peak_step=None, peak_to_median=None)
    if series is None:
        return result
    peak_index = max(range(len(series.values)), key=series.values.__getitem__)
    median = stats.median(series.values)
    ratio = stats.peak_to_median(series.values)
    notes = [] if ratio is not None else [f"peak/median undefined: the median D3 is {median!r}"]
    return {
        **result,
        "median": median,
        "peak": series.values[peak_index],
        "peak_step": series.steps[peak_index],
        "peak_to_median": ratio,
        "notes": notes,
    }


def kl_figures(run: RunLog, window: int) -> dict:
    series, result = _read(run, KL_SOURCES, window=None, first_window_median=None, last_window_median=None,
                           last_over_first=None, median=None)
    if series is None:
        return result
    windows = _windowed(series, window, stats.median, "_median")
    ratio = stats.safe_ratio(windows["last_window_median"], windows["first_window_median"])
    if ratio is None:
        windows["notes"].append(
            "last/first undefined: the window medians are "
            f"{windows['first_window_median']!r} and {windows['last_window_median']!r} (k1 KL can be <= 0)"
        )
    return {**result, **windows, "last_over_first": ratio, "median": stats.median(series.values)}


def grad_norm_figures(run: RunLog) -> dict:
    series = select_series(run, GRAD_NORM_SOURCES)
    empty = dict(max=None, max_step=None, median=None)
    if series is None:
        return _missing(GRAD_NORM_SOURCES, **empty)
    result = _header(series)
    notes = []
    if series.non_finite:
        notes.append(f"{series.non_finite} update(s) logged a non-finite norm (verl skips those optimizer steps)")
    if not series.values:
        return {**result, **empty, "notes": notes}
    peak_index = max(range(len(series.values)), key=series.values.__getitem__)
    return {
        **result,
        "max": series.values[peak_index],
        "max_step": series.steps[peak_index],
        "median": stats.median(series.values),
        "notes": notes,
    }


def rejection_figures(run: RunLog, window: int) -> dict:
    series, result = _read(run, REJECTION_SOURCES, window=None, first_window=None, last_window=None, mean=None,
                           max=None)
    if series is None:
        return result
    return {
        **result,
        **_windowed(series, window, stats.mean, ""),
        "mean": stats.mean(series.values),
        "max": max(series.values),
    }


def bitwise_equal_figures(run: RunLog) -> dict:
    series, result = _read(run, BITWISE_EQUAL_SOURCES, min=None, min_step=None, updates_fully_equal=None)
    if series is None:
        return result
    low_index = min(range(len(series.values)), key=series.values.__getitem__)
    return {
        **result,
        "min": series.values[low_index],
        "min_step": series.steps[low_index],
        "updates_fully_equal": sum(1 for value in series.values if value == 1.0),
        "notes": [],
    }


def lag_figures(run: RunLog) -> dict:
    mean_series = select_series(run, LAG_MEAN_SOURCES)
    max_series = select_series(run, LAG_MAX_SOURCES)
    worst_series = select_series(run, LAG_WORST_MAX_SOURCES)
    spans_series = select_series(run, LAG_SPANS_MAX_SOURCES)
    result: dict = {
        "mean_per_update": None,
        "max_per_update": None,
        "worst_case_max": None,
        "spans_max": None,
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
        return {**_missing(SOURCES_BY_QUANTITY["lag"]), **result}
    if mean_series is not None and mean_series.values:
        values = mean_series.values
        result["mean_per_update"] = {
            "median": stats.median(values),
            "p90": stats.quantile(values, 0.9),
            "max": max(values),
        }
    if max_series is not None and max_series.values:
        # Lags are whole versions, so the per-update maxima form a small histogram.
        result["max_per_update"] = {
            "max": max(max_series.values),
            "median": stats.median(max_series.values),
            "counts": stats.integer_counts(max_series.values),
        }
    if worst_series is not None and worst_series.values:
        result["worst_case_max"] = max(worst_series.values)
    if spans_series is not None and spans_series.values:
        result["spans_max"] = max(spans_series.values)
    any_values = any(series.values for series in found.values())
    return {
        "status": OK if any_values else NO_FINITE_VALUES,
        "source": {name: series.source.describe() for name, series in found.items()},
        "updates": max(len(series.values) for series in found.values()),
        **result,
        "notes": [],
    }


def reward_figures(run: RunLog, window: int) -> dict:
    series, result = _read(run, REWARD_SOURCES, window=None, first_window=None, last_window=None)
    if series is None:
        return result
    return {**result, **_windowed(series, window, stats.mean, "")}


def run_figures(run: RunLog, window: int = DEFAULT_WINDOW) -> dict:
    """All diagnostics of one run, as JSON-ready nested dicts."""
    steps = run.steps
    return {
        "path": str(run.path),
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
    return {"window_requested": window, "runs": {run.label: run_figures(run, window) for run in runs}}
