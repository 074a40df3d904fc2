"""The aligned-vs-standard comparison: per-variant figures over seeds, the paper's numbers beside
them, and plots like the REINFORCE Zero paper's Figures 1 and 3.

Every figure comes from :func:`zero_mismatch_plugin.tools.report.build_report` on the runs' metric logs
(the code behind ``zmrl report``); this module only arranges them by variant and seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from zero_mismatch_plugin.tools.report import MetricLogError, build_report, load_runs, stats
from zero_mismatch_plugin.tools.report.figures import MetricSource, select_series
from zero_mismatch_plugin.tools.report.render import format_report

COMPARE_TEXT = "compare.txt"
COMPARE_JSON = "compare.json"
PLOTS_DIR = "plots"
FIGURE1 = "figure1_d3_peak_to_median.png"
FIGURE3 = "figure3_reward_and_kl.png"

# verl's token-level rejection metric (tokens a gate masked; the sequence figure counts sequences
# with at least one masked token).
TOKEN_REJECTION = MetricSource("actor/rollout_corr/rollout_rs_masked_fraction")
# The demo's measurement of the kernel gap: logprobs at the weights that sampled each token vs μ.
KERNEL_GAP = MetricSource("demo/own_version/log_prob_abs_diff_max")

# The REINFORCE Zero paper (seed: Table 2, Figures 1 and 3, the 6,000-update table), on
# DeepSeek-R1-Distill-Qwen-1.5B math. None: the paper gives no number for that cell.
PAPER_SETTING = "DeepSeek-R1-Distill-Qwen-1.5B math, 20,000-update runs (seed: REINFORCE Zero, Table 2, Figs. 1, 3)"
PAPER = {
    "aligned": {
        "d3_peak_to_median": 1.50, "kl_last_over_first": "flat", "grad_norm_max": 0.0555,
        "rejected_seqs_last": "none (no gate)", "reward": "macro pass@1 48.53% (lag 8, 6,000 updates)",
    },
    "standard_is": {
        "d3_peak_to_median": 442.54, "kl_last_over_first": 83.33, "grad_norm_max": 38.27,
        "rejected_seqs_last": "none (no gate)",
        "reward": "AIME24 pass@1 34.27% -> 13.96%; macro 45.32% at 6,000",
    },
    "standard_is_seq_gate": {"rejected_seqs_last": 0.2448, "reward": "macro pass@1 46.79% at 6,000"},
    "standard_is_token_gate": {"reward": "macro pass@1 44.59% at 6,000"},
    "sync_aligned": {"rejected_seqs_last": "none (no gate)", "reward": "macro pass@1 48.91% at 6,000"},
}


@dataclass(frozen=True)
class Row:
    key: str
    title: str
    kind: str  # "times", "number", "percent", "text"


ROWS = (
    Row("d3_peak_to_median", "D3 peak / median (whole run)", "times"),
    Row("d3_median", "D3 median", "number"),
    Row("kl_last_over_first", "KL median, last / first window", "times"),
    Row("grad_norm_max", "largest gradient norm (before clipping)", "number"),
    Row("rejected_seqs_last", "rejected sequences, last window", "percent"),
    Row("rejected_tokens_last", "rejected tokens, last window", "percent"),
    Row("reward", "reward, first -> last window (paper: pass@1)", "text"),
    Row("kernel_gap_median", "kernel gap: max |log pi - log mu| at the sampling weights, median", "number"),
    Row("own_version_bitwise_min", "tokens bit-equal at the sampling weights, min", "percent"),
    Row("lag_mean", "lag, mean versions", "number"),
)


def _last_window_mean(run, source: MetricSource, window: int) -> float | None:
    series = select_series(run, (source,))
    if series is None or not series.values:
        return None
    _, last, _ = stats.first_and_last_window(series.values, window)
    return stats.mean(last)


def _median_of(run, source: MetricSource) -> float | None:
    series = select_series(run, (source,))
    return stats.median(series.values) if series is not None and series.values else None


def _first_to_last(first: float | None, last: float | None) -> str | None:
    return None if first is None or last is None else f"{first:.3f} -> {last:.3f}"


def variant_figures(run, figures: dict, summary: Mapping | None, window: int) -> dict:
    """One run's comparison figures, from its ``zmrl report`` figures (and the demo summary)."""
    gated = figures["rejection"]["status"] != "missing"
    out = {
        "d3_peak_to_median": (figures["d3"].get("peak_to_median") if figures["d3"].get("median") != 0
                              else "undefined (D3 median 0)"),
        "d3_median": figures["d3"].get("median"),
        "kl_last_over_first": figures["kl"].get("last_over_first"),
        "kl_first_window_median": figures["kl"].get("first_window_median"),
        "kl_last_window_median": figures["kl"].get("last_window_median"),
        "grad_norm_max": figures["grad_norm"].get("max"),
        "rejected_seqs_last": figures["rejection"].get("last_window") if gated else "none (no gate)",
        "rejected_tokens_last": _last_window_mean(run, TOKEN_REJECTION, window) if gated else "none (no gate)",
        "reward_first": figures["reward"].get("first_window"),
        "reward_last": figures["reward"].get("last_window"),
        "reward": _first_to_last(figures["reward"].get("first_window"), figures["reward"].get("last_window")),
        "kernel_gap_median": _median_of(run, KERNEL_GAP),
        "own_version_bitwise_min": figures["bitwise_equal"].get("min"),
        "lag_mean": (figures["lag"].get("mean_per_update") or {}).get("median"),
    }
    if summary is not None:
        out["updates_per_second"] = summary.get("updates_per_second")
    return out


def _cell(value, kind: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if kind == "times":
        return f"{value:.2f}x"
    if kind == "percent":
        return f"{100 * value:.2f}%"
    return f"{value:.4g}"


def format_comparison(comparison: dict) -> str:
    """Per figure: one line per variant, one column per seed, the paper's number last."""
    seeds = comparison["seeds"]
    variants = comparison["variants"]
    settings = comparison["settings"]
    lines = [
        "Aligned vs standard kernels (zmrl demo --compare)",
        f"  ours:  task {settings['task']}, lag {settings['lag']}, {settings['updates']} updates, "
        f"lr {settings['learning_rate']}, seeds {', '.join(map(str, seeds))}, "
        f"first/last window {settings['window']} updates",
        f"  paper: {PAPER_SETTING}",
        "",
    ]
    title_width = max(len(v["title"]) for v in variants)
    for row in ROWS:
        table = [[row.title, *(f"seed {s}" for s in seeds), "paper"]]
        for variant in variants:
            per_seed = comparison["figures"][variant["name"]]
            paper = PAPER.get(variant["name"], {}).get(row.key)
            table.append([variant["title"], *(_cell(per_seed[str(s)][row.key], row.kind) for s in seeds),
                          _cell(paper, row.kind)])
        widths = [max(title_width, len(row.title))] + [max(len(r[c]) for r in table) for c in range(1, len(table[0]))]
        for r in table:
            lines.append("  ".join(text.ljust(width) for text, width in zip(r, widths)).rstrip())
        lines.append("")
    lines.append("Each run's own report: OUT/seed-S/VARIANT/report.txt; all variants of a seed side by side: "
                 "OUT/seed-S/report.txt (zmrl report's table).")
    return "\n".join(lines)


def _rolling(values: Sequence[float], width: int, how: str):
    import numpy as np

    array = np.asarray(values, dtype=float)
    half = max(1, width) // 2
    padded = np.pad(array, half, constant_values=np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    return (np.nanmedian if how == "median" else np.nanmean)(windows, axis=1)


def write_figure1(comparison: dict, path: Path) -> Path:
    """Like the paper's Figure 1: D3 peak/median per variant on a log axis, the paper's bars beside ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = comparison["variants"]
    figure, axes = plt.subplots(figsize=(10, 5.2), dpi=110)
    paper_labelled = False
    for index, variant in enumerate(variants):
        values = [v["d3_peak_to_median"] for v in comparison["figures"][variant["name"]].values()
                  if isinstance(v["d3_peak_to_median"], float)]
        if values:
            axes.bar(index - 0.2, stats.median(values), width=0.38, color="tab:blue",
                     label="ours (median over seeds; dots: seeds)" if index == 0 else None)
            axes.scatter([index - 0.2] * len(values), values, color="black", s=12, zorder=3)
        else:  # e.g. synchronous and aligned: D3 is 0 at every update, so the ratio has no value
            axes.text(index, 0.04, "no ratio:\nD3 median 0", ha="center", fontsize=8,
                      transform=axes.get_xaxis_transform())
        paper = PAPER.get(variant["name"], {}).get("d3_peak_to_median")
        if isinstance(paper, float):
            axes.bar(index + 0.2, paper, width=0.38, color="tab:orange", hatch="//",
                     label=None if paper_labelled else "paper (REINFORCE Zero, Table 2)")
            paper_labelled = True
            axes.annotate(f"{paper:.2f}x", (index + 0.2, paper), ha="center", va="bottom", fontsize=8)
    axes.set_yscale("log")
    axes.set_xticks(range(len(variants)), [v["title"].replace(", ", ",\n", 1) for v in variants], fontsize=8)
    axes.set_ylabel("D3 peak / median (log scale)")
    axes.set_title("Peak-to-median ratio of D3 = mean over tokens of w - 1 - log w, per update")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, bbox_inches="tight")
    plt.close(figure)
    return path


def write_figure3(comparison: dict, series: dict, path: Path) -> Path:
    """Like the paper's Figure 3: reward (left) and rollout-to-learner KL (right) per update, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(3, comparison["settings"]["window"] // 4)
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, variant in enumerate(comparison["variants"]):
        color = colors[index % len(colors)]
        for seed_index, (steps, reward, kl) in enumerate(series[variant["name"]]):
            label = variant["title"] if seed_index == 0 else None
            left.plot(steps, _rolling(reward, width, "mean"), color=color, linewidth=1.2, alpha=0.85, label=label)
            right.plot(steps, _rolling(kl, width, "median"), color=color, linewidth=1.2, alpha=0.85, label=label)
    left.set_title(f"Reward per update (rolling mean of {width}; one line per seed)")
    left.set_xlabel("update")
    left.set_ylabel("reward")
    right.set_title(f"Rollout-to-learner KL, mean(log mu - log pi) (rolling median of {width})")
    right.set_xlabel("update")
    right.set_ylabel("KL (k1)")
    for axes in (left, right):
        axes.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, bbox_inches="tight")
    plt.close(figure)
    return path


def _summary_beside(log: Path) -> dict | None:
    """The demo's summary.json next to a run's metric log, when there is one."""
    path = Path(log).parent / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_comparison(logs: Mapping[int, Mapping[str, Path]], variants: Sequence, settings: dict,
                     summaries: Mapping[int, Mapping[str, Mapping]] | None, out_dir: Path) -> dict:
    """Read every run's log through ``zmrl report``'s code; write the table, JSON and plots to ``out_dir``."""
    from zero_mismatch_plugin.tools.report.plots import write_plots

    window = settings["window"]
    seeds = sorted(logs)
    figures: dict[str, dict[str, dict]] = {v.name: {} for v in variants}
    curves: dict[str, list] = {v.name: [] for v in variants}
    plot_files: dict[str, str] = {}
    for seed in seeds:
        runs = load_runs([f"{v.name}={logs[seed][v.name]}" for v in variants])
        if [run.label for run in runs] != [v.name for v in variants]:
            # A log holding several runs is read as several columns; a variant is one run.
            raise MetricLogError("; ".join(w for run in runs for w in run.warnings) or "a variant's log holds "
                                 "more than one run")
        report = build_report(runs, window=window)
        seed_dir = out_dir / f"seed-{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        (seed_dir / "report.txt").write_text(format_report(report) + "\n", encoding="utf-8")
        for name, path in write_plots(runs, out_dir / PLOTS_DIR / f"seed-{seed}").items():
            if path:
                plot_files[f"seed-{seed}/{name}"] = str(path)
        for variant, run in zip(variants, runs):
            summary = (summaries or {}).get(seed, {}).get(variant.name) or _summary_beside(logs[seed][variant.name])
            figures[variant.name][str(seed)] = variant_figures(run, report["runs"][variant.name], summary, window)
            reward = select_series(run, (MetricSource("critic/score/mean"),))
            kl = select_series(run, (MetricSource("actor/rollout_corr/kl"),))
            curves[variant.name].append((reward.steps, reward.values, kl.values))
    comparison = {
        "settings": settings,
        "seeds": seeds,
        "variants": [{"name": v.name, "title": v.title} for v in variants],
        "paper": PAPER,
        "paper_setting": PAPER_SETTING,
        "figures": figures,
        "logs": {str(seed): {name: str(path) for name, path in by.items()} for seed, by in logs.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    plot_files[FIGURE1] = str(write_figure1(comparison, out_dir / PLOTS_DIR / FIGURE1))
    plot_files[FIGURE3] = str(write_figure3(comparison, curves, out_dir / PLOTS_DIR / FIGURE3))
    comparison["plots"] = plot_files
    (out_dir / COMPARE_TEXT).write_text(format_comparison(comparison) + "\n", encoding="utf-8")
    with open(out_dir / COMPARE_JSON, "w", encoding="utf-8") as handle:
        json.dump(comparison, handle, indent=2)
    return comparison


def read_comparison(out_dir: Path) -> dict:
    """Rebuild the comparison from a ``zmrl demo --compare`` output folder's logs (no rerun)."""
    stored = json.loads((Path(out_dir) / COMPARE_JSON).read_text())
    from types import SimpleNamespace

    variants = [SimpleNamespace(**v) for v in stored["variants"]]
    logs = {int(seed): {name: Path(path) for name, path in by.items()} for seed, by in stored["logs"].items()}
    return write_comparison(logs, variants, stored["settings"], None, Path(out_dir))
