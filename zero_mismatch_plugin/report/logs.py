"""Reading metric logs: verl's ``file`` logger output and plain JSONL.

verl's ``file`` backend (``FileLogger`` in ``verl/utils/tracking.py``) writes one line per
``Tracking.log(data, step)`` call, ``{"step": <int>, "data": {<metric>: <value>, ...}}``, to
``$VERL_FILE_LOGGER_PATH`` or ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``. It
serialises with orjson, which writes NaN and ±inf as ``null``. The trainers call ``log`` more
than once for some steps (validation metrics and training metrics separately), so records
sharing a step are merged.

A plain JSONL log has the metrics at the top level: ``{"step": <int>, <metric>: <value>, ...}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

VERL_FILE_FORMAT = "verl-file"
PLAIN_JSONL_FORMAT = "jsonl"


class MetricLogError(ValueError):
    """The file is not a metric log; the message names the file and, where it applies, the line."""


@dataclass
class RunLog:
    """Per-step metrics of one run. ``None`` stands for a value logged as NaN, inf or null."""

    label: str
    path: Path
    formats: set[str] = field(default_factory=set)
    metrics_by_step: dict[int, dict[str, float | None]] = field(default_factory=dict)

    @property
    def steps(self) -> list[int]:
        return sorted(self.metrics_by_step)

    def has(self, key: str) -> bool:
        return any(key in metrics for metrics in self.metrics_by_step.values())

    def series(self, key: str) -> list[tuple[int, float | None]]:
        """``(step, value)`` for every step that logged ``key``, in step order."""
        return [
            (step, self.metrics_by_step[step][key]) for step in self.steps if key in self.metrics_by_step[step]
        ]


def resolve_log_path(path: str | Path) -> Path:
    """A log file, or a directory holding exactly one ``*.jsonl`` (verl's ``<root>/<project>/``)."""
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("*.jsonl"))
        if len(candidates) != 1:
            found = ", ".join(c.name for c in candidates) or "none"
            raise MetricLogError(f"{path}: a run directory must hold exactly one *.jsonl log (found: {found})")
        return candidates[0]
    if not path.is_file():
        raise MetricLogError(f"{path}: no such file")
    return path


def _metric_value(value: object) -> tuple[bool, float | None]:
    """(is a scalar metric, its finite value or None)."""
    if value is None:
        return True, None  # orjson's rendering of NaN / inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False, None  # strings, lists, tables: not a per-update scalar
    number = float(value)
    return True, number if math.isfinite(number) else None


def _step_of(record: dict, where: str) -> int:
    if "step" not in record:
        raise MetricLogError(f"{where}: not a metric log record: no 'step' key (keys: {sorted(record)[:8]})")
    step = record["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not float(step).is_integer():
        raise MetricLogError(f"{where}: not a metric log record: 'step' is {step!r}, expected an integer")
    return int(step)


def read_metric_log(path: str | Path, label: str | None = None) -> RunLog:
    """Read one run's log; raise ``MetricLogError`` naming the file and line on anything else."""
    log_path = resolve_log_path(path)
    run = RunLog(label=label or log_path.stem, path=log_path)
    with open(log_path, "rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            where = f"{log_path}:{line_number}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise MetricLogError(f"{where}: not a metric log: not UTF-8 text ({error.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)  # also accepts the NaN/Infinity literals Python's json writes
            except json.JSONDecodeError as error:
                raise MetricLogError(f"{where}: not a metric log: invalid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise MetricLogError(
                    f"{where}: not a metric log record: expected a JSON object, got {type(record).__name__}"
                )
            step = _step_of(record, where)
            if set(record) == {"step", "data"} and isinstance(record["data"], dict):
                run.formats.add(VERL_FILE_FORMAT)
                metrics = record["data"]
            else:
                run.formats.add(PLAIN_JSONL_FORMAT)
                metrics = {key: value for key, value in record.items() if key != "step"}
            merged = run.metrics_by_step.setdefault(step, {})
            for key, value in metrics.items():
                is_scalar, number = _metric_value(value)
                if is_scalar:
                    merged[key] = number  # a later record for the same step and key wins
    if not run.metrics_by_step:
        raise MetricLogError(f"{log_path}: not a metric log: no records")
    return run


def parse_run_argument(argument: str) -> tuple[str | None, str]:
    """``LABEL=PATH`` names a run; a plain path (or one that exists as given) is labelled by its stem."""
    label, separator, path = argument.partition("=")
    if separator and label and "/" not in label and not Path(argument).exists():
        return label, path
    return None, argument
