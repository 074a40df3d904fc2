"""What a demo run leaves behind: verl-format metric log, summary.json, the report and its plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .runner import DemoResult, config_dict

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.txt"
PLOTS_DIR = "plots"
# The loss's bitwise-equal fraction: logprobs under the learner's current weights vs μ (includes lag).
VS_CURRENT_KEY = "actor/zero_mismatch/bitwise_equal_fraction"


def write_metrics_log(result: DemoResult, path: Path) -> Path:
    """verl's file-logger format: one ``{"step": N, "data": {...}}`` line per update."""
    with open(path, "w", encoding="utf-8") as handle:
        for record in result.records:
            data = {k: (v if math.isfinite(v) else None) for k, v in record.metrics.items()}
            handle.write(json.dumps({"step": record.step, "data": data}) + "\n")
    return path


def _fifth(updates: int) -> int:
    return max(1, updates // 5)


def summarize(result: DemoResult, report: dict, label: str) -> dict:
    """The run's headline numbers; reward and D3 figures come from ``zmrl report``'s own code."""
    records = result.records
    figures = report["runs"][label]
    own_fractions = [r.metrics["demo/own_version/bitwise_equal_fraction"] for r in records
                     if "demo/own_version/bitwise_equal_fraction" in r.metrics]
    fresh, older, older_ratio_not_one, fresh_ratio_not_one = 0, 0, 0, 0
    for r in records:
        for version, ratios_one in zip(r.sample_versions, r.ratios_all_one):
            if version == r.learner_version:
                fresh += 1
                fresh_ratio_not_one += not ratios_one
            else:
                older += 1
                older_ratio_not_one += not ratios_one
    staleness_max = [r.metrics["training/off_policy/trajectory_staleness/max"] for r in records]
    staleness_mean = [r.metrics["training/off_policy/trajectory_staleness/mean"] for r in records]
    own_d3 = [r.metrics["demo/own_version/k3_kl"] for r in records if "demo/own_version/k3_kl" in r.metrics]
    vs_current = [r.metrics[VS_CURRENT_KEY] for r in records if VS_CURRENT_KEY in r.metrics]
    return {
        **{key: value for key, value in config_dict(result.config).items()},
        "updates": len(records),
        # Over tokens scored with the weight version that sampled them: kernel mismatch only, at any lag.
        "bitwise_equal_fraction_min": min(own_fractions) if own_fractions else None,
        "own_version_d3_max": max(own_d3) if own_d3 else None,
        "fresh_samples": fresh,
        "fresh_samples_with_is_ratio_not_one": fresh_ratio_not_one,
        "older_samples": older,
        "older_samples_with_is_ratio_not_one": older_ratio_not_one,
        "lag_max": int(max(staleness_max)),
        "lag_mean": sum(staleness_mean) / len(staleness_mean),
        "reward_window": figures["reward"]["window"],
        "reward_first": figures["reward"]["first_window"],
        "reward_last": figures["reward"]["last_window"],
        "d3_median": figures["d3"]["median"],
        "d3_peak": figures["d3"]["peak"],
        "d3_peak_to_median": figures["d3"]["peak_to_median"],
        # From the loss's own metric, not the report's bitwise figure: the report prefers the
        # own-version fraction when a log has it, which would hide the weight lag meant here.
        "bitwise_equal_fraction_min_vs_current_weights": min(vs_current) if vs_current else None,
        "prefix_cache_cached_prompt_tokens": int(sum(
            r.metrics.get("demo/prefix_cache/cached_prompt_tokens", 0.0) for r in records)),
        "updates_per_second": len(records) / result.loop_seconds,
        "loop_seconds": result.loop_seconds,
    }


def write_outputs(result: DemoResult, out_dir: Path, label: str = "demo", window: int | None = None,
                  plots: bool = True) -> dict:
    """Metric log, report, plots (unless ``plots`` is false) and summary.json under ``out_dir``.

    ``window``: updates in the report's first and last windows (default: a fifth of the run).
    Returns the summary.
    """
    from zero_mismatch_plugin.report import build_report, load_runs
    from zero_mismatch_plugin.report.plots import write_plots
    from zero_mismatch_plugin.report.render import format_report

    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = write_metrics_log(result, out_dir / METRICS_FILE)
    runs = load_runs([f"{label}={metrics_path}"])
    report = build_report(runs, window=window or _fifth(len(result.records)))
    (out_dir / REPORT_FILE).write_text(format_report(report) + "\n", encoding="utf-8")
    plot_files = ({name: str(path) for name, path in write_plots(runs, out_dir / PLOTS_DIR).items() if path}
                  if plots else {})
    summary = summarize(result, report, label)
    summary["files"] = {"metrics": str(metrics_path), "report": str(out_dir / REPORT_FILE), "plots": plot_files}
    with open(out_dir / SUMMARY_FILE, "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    return summary


def _number(value) -> str:
    if value is None:
        return "undefined"
    return f"{value:.4g}"


def format_summary(summary: dict, out_dir: Path) -> str:
    s = summary
    fresh_line = (
        f"{s['fresh_samples']} samples drawn by the learner's own version: "
        f"{s['fresh_samples'] - s['fresh_samples_with_is_ratio_not_one']} with every IS ratio exactly 1"
    )
    older_line = (
        f"{s['older_samples']} samples from older versions (lag <= {s['lag']}): "
        f"{s['older_samples_with_is_ratio_not_one']} with IS ratio != 1 (weight lag, corrected by IS)"
    )
    lines = [
        f"zmrl demo: {s['algo']}, {s['kernels']} kernels"
        + (f", frozen base + rank-{s['lora_rank']} LoRA" if s.get("lora_rank") else "")
        + f", lag bound K={s['lag']}, seed {s['seed']}",
        f"  updates            {s['updates']} in {s['loop_seconds']:.1f} s ({s['updates_per_second']:.2f} updates/s)",
        f"  reward             {_number(s['reward_first'])} (first {s['reward_window']} updates) -> "
        f"{_number(s['reward_last'])} (last {s['reward_window']})",
        f"  bitwise equal      min {_number(s['bitwise_equal_fraction_min'])} of tokens, scored with the weights "
        f"that sampled them",
        f"  vs current weights min {_number(s['bitwise_equal_fraction_min_vs_current_weights'])} "
        f"(the loss's own metric: includes weight lag)",
        f"  lag                max {s['lag_max']}, mean {s['lag_mean']:.2f} versions",
        f"  D3 peak/median     {_number(s['d3_peak_to_median'])} (median {_number(s['d3_median'])}, "
        f"peak {_number(s['d3_peak'])})",
        f"  {fresh_line}",
        f"  {older_line}",
        *([f"  {s['turns']} turns per conversation, each re-sent whole: "
           f"{s['prefix_cache_cached_prompt_tokens']} prompt tokens from the engine's prefix cache"]
          if s["turns"] > 1 else []),
        f"summary: {out_dir / SUMMARY_FILE}",
        f"report:  {out_dir / REPORT_FILE}   (zmrl report {out_dir / METRICS_FILE})",
        f"plots:   {out_dir / PLOTS_DIR}/ ({', '.join(sorted(Path(p).name for p in s['files']['plots'].values()))})",
    ]
    return "\n".join(lines)
