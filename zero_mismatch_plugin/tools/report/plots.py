"""PNG plots of per-update metrics, one figure per quantity, every run overlaid."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from zero_mismatch_plugin.tools.report.figures import (
    D3_SOURCES,
    GRAD_NORM_SOURCES,
    KL_SOURCES,
    REJECTION_SOURCES,
    REWARD_SOURCES,
    MetricSource,
    select_series,
)
from zero_mismatch_plugin.tools.report.logs import RunLog

# Above this many updates the raw curve is drawn faint and a rolling median on top, since a
# 20,000-point line is a solid band.
SMOOTH_ABOVE = 200
SMOOTHING_FRACTION = 0.02


@dataclass(frozen=True)
class PlotSpec:
    filename: str
    title: str
    ylabel: str
    sources: Sequence[MetricSource]
    log_scale: bool = False
    percent: bool = False


PLOTS = (
    PlotSpec(
        "d3.png", "D3 per update: mean over tokens of w - 1 - log w", "D3 (log scale)", D3_SOURCES, log_scale=True
    ),
    PlotSpec("kl.png", "Rollout-to-learner KL per update: mean(log mu - log pi)", "KL (k1)", KL_SOURCES),
    PlotSpec("reward.png", "Reward per update (batch mean)", "reward", REWARD_SOURCES),
    PlotSpec(
        "rejection.png", "Sequences rejected by a gate, per update", "rejected sequences", REJECTION_SOURCES,
        percent=True,
    ),
    PlotSpec(
        "grad_norm.png", "Gradient norm before clipping, per update", "grad norm (log scale)", GRAD_NORM_SOURCES,
        log_scale=True,
    ),
)


def _rolling_median(values, width: int):
    import numpy as np

    array = np.asarray(values, dtype=float)
    half = width // 2
    # NaN padding makes the window shrink at both ends instead of repeating the end value,
    # which would pull the curve toward a single update there.
    padded = np.pad(array, half, constant_values=np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    return np.nanmedian(windows, axis=1)


def draw_quantity(runs: Sequence[RunLog], spec: PlotSpec):
    """A matplotlib Figure of one quantity, every run overlaid; None when no run logged it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    figure, axes = plt.subplots(figsize=(10, 5.2), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    logged = 0  # runs with values for this quantity
    drawn = 0  # runs with a curve on the axes
    for index, run in enumerate(runs):
        series = select_series(run, spec.sources)
        color = colors[index % len(colors)]
        if series is None or not series.values:
            # Keep the run in the legend so its absence reads as "not logged", not as a hidden curve.
            if series is not None:
                reason = "no finite values"
            elif any(source.key in run.not_numbers for source in spec.sources):
                reason = "logged, but not as a number"
            else:
                reason = "not logged"
            axes.plot([], [], color=color, linestyle=":", label=f"{run.label}: {reason}")
            continue
        logged += 1
        steps, values = series.steps, series.values
        label = f"{run.label}  [{series.source.describe()}]"
        if series.non_finite:
            kinds = ", ".join(f"{n} {kind}" for kind, n in series.non_finite_counts().items())
            label += f" ({kinds} not drawn)"
        if spec.log_scale:
            kept = [(s, v) for s, v in zip(steps, values) if v > 0]
            if not kept:
                # A log axis cannot show 0; say so instead of drawing an empty curve.
                axes.plot([], [], color=color, label=f"{label}: every value is <= 0, none drawable on a log axis")
                continue
            if len(kept) < len(values):
                label += f" ({len(values) - len(kept)} value(s) <= 0 not drawn)"
            steps, values = [s for s, _ in kept], [v for _, v in kept]
        if len(values) > SMOOTH_ABOVE:
            width = max(3, int(len(values) * SMOOTHING_FRACTION) | 1)
            axes.plot(steps, values, color=color, linewidth=0.6, alpha=0.3)
            axes.plot(steps, _rolling_median(values, width), color=color, linewidth=1.8,
                      label=f"{label}, rolling median of {width}")
        else:
            axes.plot(steps, values, color=color, linewidth=1.4, marker="." if len(values) < 60 else None,
                      label=label)
        drawn += 1
    if logged == 0:
        plt.close(figure)
        return None
    if spec.log_scale and drawn:
        axes.set_yscale("log")
    if spec.percent:
        axes.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    axes.set_title(spec.title)
    axes.set_xlabel("training step")
    axes.set_ylabel(spec.ylabel)
    axes.grid(True, which="major", alpha=0.3)
    # Below the axes, so the legend never hides a curve.
    axes.legend(loc="upper left", bbox_to_anchor=(0.0, -0.13), fontsize=8, frameon=False)
    figure.tight_layout()
    return figure


def plot_quantity(runs: Sequence[RunLog], spec: PlotSpec, out_dir: Path) -> Path | None:
    """Write ``out_dir/spec.filename``; None (and no file) when no run logged the quantity."""
    figure = draw_quantity(runs, spec)  # selects the Agg backend before pyplot is imported here
    if figure is None:
        return None
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / spec.filename
    figure.savefig(path, bbox_inches="tight")
    plt.close(figure)
    return path


def write_plots(runs: Sequence[RunLog], out_dir: str | Path) -> dict[str, Path | None]:
    """Write every plot; the value is None for a quantity no run logged."""
    out_dir = Path(out_dir)
    return {spec.filename: plot_quantity(runs, spec, out_dir) for spec in PLOTS}
