"""Text rendering of a report: one column per run, then the key each figure came from."""

from __future__ import annotations

import math
from typing import Callable

from zero_mismatch_plugin.tools.report.figures import MISSING, NOT_A_NUMBER, OK


MAX_LAG_ENTRIES = 8


def _finite_or(fmt: Callable[[float], str]) -> Callable[[float], str]:
    """``fmt`` for a finite value; ``inf``, ``-inf`` or ``nan`` as such, never as a number."""
    def format_value(value: float) -> str:
        return fmt(value) if math.isfinite(value) else str(value)

    return format_value


_number = _finite_or(lambda value: f"{value:.4g}")
_times = _finite_or(lambda value: f"{value:.2f}x")
_percent = _finite_or(lambda value: f"{100 * value:.2f}%")


def _non_finite(figures: dict) -> str | None:
    """``0``, or the count and its kinds: ``3 (2 NaN, 1 inf)``."""
    count = figures.get("non_finite")
    if count is None:
        return None
    kinds = figures.get("non_finite_counts") or {}
    return str(count) + (" (" + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + ")" if kinds else "")


def _at_step(value_key: str, step_key: str, fmt: Callable[[float], str] = _number) -> Callable[[dict], str | None]:
    def cell(figures: dict) -> str | None:
        if figures.get(value_key) is None:
            return None
        return f"{fmt(figures[value_key])} @{figures[step_key]}"

    return cell


def _plain(value_key: str, fmt: Callable[[float], str] = _number) -> Callable[[dict], str | None]:
    def cell(figures: dict) -> str | None:
        value = figures.get(value_key)
        return None if value is None else fmt(value)

    return cell


def _window_steps(which: str) -> Callable[[dict], str | None]:
    def cell(figures: dict) -> str | None:
        steps = figures.get(f"{which}_window_steps")
        if steps is None:
            return None
        return f"{figures['window']} (steps {steps[0]}-{steps[1]})"

    return cell


def _nested(outer: str, inner: str, fmt: Callable[[float], str] = _number) -> Callable[[dict], str | None]:
    def cell(figures: dict) -> str | None:
        group = figures.get(outer)
        if group is None or group.get(inner) is None:
            return None
        return fmt(group[inner])

    return cell


def _lag_counts(figures: dict) -> str | None:
    group = figures.get("max_per_update")
    if group is None or group.get("counts") is None:
        return None
    entries = [f"{lag}:{count}" for lag, count in group["counts"].items()]
    if len(entries) > MAX_LAG_ENTRIES:
        # Long lag ranges would widen the whole column; the JSON keeps every count.
        entries = entries[: MAX_LAG_ENTRIES - 1] + ["...", entries[-1]]
    return " ".join(entries)


ROWS: list[tuple[str, str, Callable[[dict], str | None]]] = [
    ("D3 median", "d3", _plain("median")),
    ("D3 peak @step", "d3", _at_step("peak", "peak_step")),
    ("D3 peak / median", "d3", _plain("peak_to_median", _times)),
    ("D3 non-finite updates", "d3", _non_finite),
    ("KL median, first window", "kl", _plain("first_window_median")),
    ("KL median, last window", "kl", _plain("last_window_median")),
    ("KL last / first", "kl", _plain("last_over_first", _times)),
    ("KL window: first", "kl", _window_steps("first")),
    ("KL window: last", "kl", _window_steps("last")),
    ("grad norm max @step", "grad_norm", _at_step("max", "max_step")),
    ("grad norm median", "grad_norm", _plain("median")),
    ("grad norm non-finite updates", "grad_norm", _non_finite),
    ("rejected seqs, first window", "rejection", _plain("first_window", _percent)),
    ("rejected seqs, last window", "rejection", _plain("last_window", _percent)),
    ("rejection window", "rejection", _plain("window", str)),
    ("bitwise-equal min @step", "bitwise_equal", _at_step("min", "min_step", _percent)),
    ("updates 100% bitwise-equal", "bitwise_equal", _plain("updates_fully_equal", str)),
    ("lag, per-update mean: median", "lag", _nested("mean_per_update", "median")),
    ("lag, per-update mean: p90", "lag", _nested("mean_per_update", "p90")),
    ("lag, per-update max: max", "lag", _nested("max_per_update", "max")),
    ("lag, per-update max: lag:updates", "lag", _lag_counts),
    ("lag, worst case: max", "lag", _plain("worst_case_max")),
    ("reward, first window mean", "reward", _plain("first_window")),
    ("reward, last window mean", "reward", _plain("last_window")),
    ("reward window", "reward", _plain("window", str)),
]

QUANTITY_TITLES = {
    "d3": "D3",
    "kl": "KL",
    "grad_norm": "grad norm",
    "rejection": "rejection",
    "bitwise_equal": "bitwise-equal",
    "lag": "lag",
    "reward": "reward",
}


def _cell(figures: dict, format_cell: Callable[[dict], str | None]) -> str:
    if figures["status"] in (MISSING, NOT_A_NUMBER):
        return figures["status"]
    text = format_cell(figures)
    if figures["status"] != OK:
        # No finite value: a figure that still exists (an infinite peak, the non-finite count) is shown.
        return figures["status"] if text is None else text
    return "undefined" if text is None else text


def _source_text(figures: dict) -> str:
    if figures["status"] == MISSING:
        return "missing (looked for: " + ", ".join(figures["looked_for"]) + ")"
    if figures["status"] == NOT_A_NUMBER:
        return "present but not a number (looked for: " + ", ".join(figures["looked_for"]) + ")"
    source = figures["source"]
    if isinstance(source, dict):
        text = ", ".join(f"{name} <- {key}" for name, key in source.items())
    else:
        text = source
    if figures.get("also_present"):
        text += " (also logged, not used: " + ", ".join(figures["also_present"]) + ")"
    return text


def format_report(report: dict) -> str:
    runs = report["runs"]
    labels = list(runs)
    header = ["", *labels]
    table = [header, ["steps logged", *(str(runs[label]["steps_logged"]) for label in labels)]]
    for title, quantity, format_cell in ROWS:
        table.append([title, *(_cell(runs[label][quantity], format_cell) for label in labels)])
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    lines = [f"Run diagnostics (window: {report['window_requested']} updates requested)", ""]
    for warning in report.get("warnings", []):
        lines += [f"WARNING: {warning}", ""]
    for row in table:
        lines.append("  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip())
    lines += ["", "Keys each figure was read from:"]
    for label in labels:
        where = runs[label]["path"]
        if runs[label].get("segment"):
            where += ", lines {}-{}: run {index} of {of} in that file".format(*runs[label]["lines"],
                                                                               **runs[label]["segment"])
        lines.append(f"  {label} ({where})")
        for quantity, title in QUANTITY_TITLES.items():
            figures = runs[label][quantity]
            lines.append(f"    {title:<14} {_source_text(figures)}")
            for note in figures.get("notes", []):
                lines.append(f"    {'':<14}   note: {note}")
    return "\n".join(lines)
