"""``zmrl report``: run diagnostics from the metric logs verl writes.

- ``stats``: run-level statistics over per-update values (framework-free);
- ``logs``: reading verl's ``file`` logger output and plain JSONL;
- ``figures``: which keys feed each diagnostic, and the figures per run;
- ``render``: the side-by-side text table; ``plots``: the PNG figures.
"""

from __future__ import annotations

from typing import Sequence

from zero_mismatch_plugin.tools.report.figures import DEFAULT_WINDOW, build_report
from zero_mismatch_plugin.tools.report.logs import MetricLogError, RunLog, parse_run_argument, read_run_segments

__all__ = ["DEFAULT_WINDOW", "MetricLogError", "RunLog", "build_report", "load_runs"]


def load_runs(arguments: Sequence[str]) -> list[RunLog]:
    """Read every ``PATH`` or ``LABEL=PATH``, one run per segment of a file holding several;
    labels are made unique so columns stay distinct."""
    runs: list[RunLog] = []
    seen: dict[str, int] = {}
    for argument in arguments:
        label, path = parse_run_argument(argument)
        for run in read_run_segments(path, label):
            count = seen.get(run.label, 0)
            seen[run.label] = count + 1
            if count:
                run.label = f"{run.label}#{count + 1}"
            runs.append(run)
    return runs
