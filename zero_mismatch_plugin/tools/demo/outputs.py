"""What a demo run leaves behind: verl-format metric log, summary.json, the report and its plots.

The metric log is appended and flushed after every update (:class:`MetricsLog`), so an interrupted
run keeps what it measured; the other files are written at the end, each atomically (a temporary
file, then ``os.replace``): a full disk leaves a file absent, never half-written, and the files
that could be written are kept (:class:`OutputsNotWritten` names the others).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the runner imports torch; the file names here are needed before any work
    from zero_mismatch_plugin.tools.demo.runner import DemoResult, UpdateRecord

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.txt"
PLOTS_DIR = "plots"
# What a finished or running demo leaves in its output directory.
RUN_OUTPUTS = (METRICS_FILE, SUMMARY_FILE, REPORT_FILE)
# The loss's bitwise-equal fraction: logprobs under the learner's current weights vs μ (includes lag).
VS_CURRENT_KEY = "actor/zero_mismatch/bitwise_equal_fraction"


class OutputsNotWritten(OSError):
    """Some of the run's files could not be written (the others were); ``failures``: path -> reason."""

    def __init__(self, failures: dict[str, str], summary: dict):
        self.failures = failures
        self.summary = summary
        super().__init__("; ".join(f"{path}: {why}" for path, why in failures.items()))


def _write_file(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: Path, text: str) -> Path:
    """``text`` into ``path`` through a temporary file in the same directory and ``os.replace``:
    ``path`` is either the whole text or as before, never part of it."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_file(temporary, text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    return path


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def metrics_line(record: "UpdateRecord") -> str:
    """One update in verl's file-logger format: ``{"step": N, "data": {...}}``."""
    data = {k: (v if math.isfinite(v) else None) for k, v in record.metrics.items()}
    return json.dumps({"step": record.step, "data": data}) + "\n"


def write_metrics_log(result: "DemoResult", path: Path) -> Path:
    """verl's file-logger format: one ``{"step": N, "data": {...}}`` line per update."""
    return write_atomic(path, "".join(metrics_line(r) for r in result.records))


class MetricsLog:
    """The metric log of a running demo: one line appended and flushed per update.

    A write that fails (a full disk) stops the appending and is remembered in ``error``; the run
    goes on, and :func:`write_outputs` writes the whole log again at the end.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lines = 0
        self.error: OSError | None = None
        self._handle = open(self.path, "a", encoding="utf-8")

    def append(self, record: "UpdateRecord") -> None:
        if self._handle is None:
            return
        try:
            self._handle.write(metrics_line(record))
            self._handle.flush()
            self.lines += 1
        except OSError as error:
            self.error = error
            self.close()

    def complete_for(self, result: "DemoResult") -> bool:
        """Holds every update of ``result``, each written whole."""
        return self.error is None and self.lines == len(result.records)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()


def run_log(result: "DemoResult", label: str, path: Path):
    """The run as ``zmrl report`` reads it back from its metric log, built from the records (the
    report does not depend on the log having reached the disk)."""
    from zero_mismatch_plugin.tools.report.logs import VERL_FILE_FORMAT, RunLog

    steps = {r.step: {k: (v if math.isfinite(v) else None) for k, v in r.metrics.items()} for r in result.records}
    return RunLog(label=label, path=Path(path), formats={VERL_FILE_FORMAT}, metrics_by_step=steps)


def _fifth(updates: int) -> int:
    return max(1, updates // 5)


def summarize(result: "DemoResult", report: dict, label: str) -> dict:
    """The run's headline numbers; reward and D3 figures come from ``zmrl report``'s own code."""
    from zero_mismatch_plugin.tools.demo.learners import ALIGNED
    from zero_mismatch_plugin.tools.demo.runner import config_dict

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
    own_checks = [own for r in records for own in r.own_version_bitwise if own is not None]
    own_not_bitwise = sum(not own for own in own_checks)
    own_d3 = [r.metrics["demo/own_version/k3_kl"] for r in records if "demo/own_version/k3_kl" in r.metrics]
    vs_current = [r.metrics[VS_CURRENT_KEY] for r in records if VS_CURRENT_KEY in r.metrics]
    return {
        **{key: value for key, value in config_dict(result.config).items()},
        "updates": len(records),
        # Over tokens scored with the weight version that sampled them: kernel mismatch only, at any lag.
        "bitwise_equal_fraction_min": min(own_fractions) if own_fractions else None,
        "own_version_d3_max": max(own_d3) if own_d3 else None,
        "own_version_samples_scored": len(own_checks),
        "own_version_samples_not_bitwise": own_not_bitwise,
        # The aligned kernels claim every sample scored with its own weights version is the engine's
        # bits (so every fresh sample has IS ratio 1); None: the standard kernels claim nothing.
        "bitwise_claim_holds": ((own_not_bitwise == 0 and fresh_ratio_not_one == 0)
                                if result.config.kernels == ALIGNED else None),
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


def write_outputs(result: "DemoResult", out_dir: Path, label: str = "demo", window: int | None = None,
                  plots: bool = True, metrics_log: MetricsLog | None = None) -> dict:
    """Metric log, report, plots (unless ``plots`` is false) and summary.json under ``out_dir``.

    ``window``: updates in the report's first and last windows (default: a fifth of the run).
    ``metrics_log``: the log the run appended to; written again only if it is not complete.
    Returns the summary; raises :class:`OutputsNotWritten` (after writing every file it could)
    when a file could not be written.
    """
    from zero_mismatch_plugin.tools.report import build_report
    from zero_mismatch_plugin.tools.report.plots import write_plots
    from zero_mismatch_plugin.tools.report.render import format_report

    out_dir.mkdir(parents=True, exist_ok=True)
    failures: dict[str, str] = {}
    metrics_path = out_dir / METRICS_FILE
    if metrics_log is not None:
        metrics_log.close()
    if metrics_log is None or not metrics_log.complete_for(result):
        try:
            write_metrics_log(result, metrics_path)
        except OSError as error:
            failures[str(metrics_path)] = _reason(error)
    runs = [run_log(result, label, metrics_path)]
    report = build_report(runs, window=window or _fifth(len(result.records)))
    try:
        write_atomic(out_dir / REPORT_FILE, format_report(report) + "\n")
    except OSError as error:
        failures[str(out_dir / REPORT_FILE)] = _reason(error)
    plot_files = {}
    if plots:
        try:
            plot_files = {name: str(path) for name, path in write_plots(runs, out_dir / PLOTS_DIR).items() if path}
        except OSError as error:
            failures[str(out_dir / PLOTS_DIR) + "/"] = _reason(error)
    summary = summarize(result, report, label)
    summary["files"] = {"metrics": str(metrics_path), "report": str(out_dir / REPORT_FILE), "plots": plot_files}
    try:
        write_atomic(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
    except OSError as error:
        failures[str(out_dir / SUMMARY_FILE)] = _reason(error)
    if failures:
        raise OutputsNotWritten(failures, summary)
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
        + (f", fixed lag K={s['lag']}" if s.get("fixed_lag") else f", lag bound K={s['lag']}") + f", seed {s['seed']}",
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
