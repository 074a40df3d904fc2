"""Reading metric logs: verl's ``file`` logger output and plain JSONL.

verl's records (``{"step": ..., "data": {...}}``, NaN and ±inf written as ``null``) and plain ones
(metrics at the top level) are read alike; consecutive records of one step are merged, and a step
lower than the one before starts another run. See docs/diagnostics.md, "Which logs it reads".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

VERL_FILE_FORMAT = "verl-file"
PLAIN_JSONL_FORMAT = "jsonl"
# More step-backs than this is not a few runs one after another but steps out of order.
MAX_RUNS_PER_FILE = 8
# A training step is a machine integer in every trainer; beyond this it is not a step.
MAX_STEP = 2**63 - 1
# verl's lines are kilobytes; a longer "line" is another kind of file (weights, an archive).
MAX_LINE_BYTES = 64 * 2**20
EXAMPLES_KEPT = 3  # per key, of values that are not numbers / conflicting duplicates


class MetricLogError(ValueError):
    """The file is not a metric log; the message names the file and, where it applies, the line."""


@dataclass
class Occurrences:
    """How often something happened to one key, and where the first few times were (``file:line: what``)."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, example: str) -> None:
        self.count += 1
        if len(self.examples) < EXAMPLES_KEPT:
            self.examples.append(example)

    def describe(self) -> str:
        more = self.count - len(self.examples)
        return "; ".join(self.examples) + (f"; and {more} more" if more else "")


@dataclass
class RunLog:
    """Per-step metrics of one run: floats as logged (NaN, ±inf kept), ``None`` for ``null``.

    ``not_numbers`` / ``conflicts``: per key, where a value was not a number / differed from one
    logged earlier at the same step. ``lines``: the file lines read; ``segment``: ``(index, count)``
    when the file holds several runs.
    """

    label: str
    path: Path
    formats: set[str] = field(default_factory=set)
    metrics_by_step: dict[int, dict[str, float | None]] = field(default_factory=dict)
    not_numbers: dict[str, Occurrences] = field(default_factory=dict)
    conflicts: dict[str, Occurrences] = field(default_factory=dict)
    lines: tuple[int, int] | None = None
    segment: tuple[int, int] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return sorted(self.metrics_by_step)

    def has(self, key: str) -> bool:
        return any(key in metrics for metrics in self.metrics_by_step.values())

    def series(self, key: str) -> list[tuple[int, float | None]]:
        """``(step, value)`` for every step that logged ``key`` as a number or null, in step order."""
        return [
            (step, self.metrics_by_step[step][key]) for step in self.steps if key in self.metrics_by_step[step]
        ]


def resolve_log_path(path: str | Path) -> Path:
    """A log file, or a directory holding exactly one ``*.jsonl`` (verl's ``<root>/<project>/``)."""
    if str(path) == "":
        raise MetricLogError("empty path: name a metric log file or a directory holding one")
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("*.jsonl"))
        if len(candidates) != 1:
            found = ", ".join(c.name for c in candidates) or "none"
            raise MetricLogError(f"{path}: a run directory must hold exactly one *.jsonl log (found: {found})")
        if not candidates[0].is_file():
            raise MetricLogError(f"{candidates[0]}: the run directory's *.jsonl is not a file (a directory?)")
        return candidates[0]
    if not path.exists():
        raise MetricLogError(f"{path}: no such file")
    if not path.is_file():
        # A FIFO or a device would block or never end; a metric log is a regular file.
        raise MetricLogError(f"{path}: not a regular file (a metric log is a .jsonl file)")
    return path


class _Literal(float):
    """A NaN / Infinity / -Infinity literal, told apart from a number that overflowed to inf."""


def _literal(text: str) -> float:
    return _Literal(text)


_BEYOND_FLOAT = "beyond the float range (about ±1.8e308); write an infinite value as Infinity or null"


def _refuse_number(value: float, key: str, where: str) -> None:
    """A float that is inf without an Infinity literal came from an overflowing number (``1e999``)."""
    if math.isinf(value):
        raise MetricLogError(f"{where}: not a metric log: {key!r} is a number {_BEYOND_FLOAT}")


def _int_metric(value: int, key: str, where: str) -> float:
    try:
        return float(value)
    except OverflowError:
        raise MetricLogError(f"{where}: not a metric log: {key!r} is an integer of {len(str(abs(value)))} "
                             f"digits, {_BEYOND_FLOAT}") from None


def _preview(value: object) -> str:
    text = json.dumps(value, allow_nan=True, default=str) if not isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _step_of(record: dict, where: str) -> int:
    if "step" not in record:
        raise MetricLogError(f"{where}: not a metric log record: no 'step' key (keys: {sorted(record)[:8]})")
    step = record["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or (
            isinstance(step, float) and not step.is_integer()):
        raise MetricLogError(f"{where}: not a metric log record: 'step' is {_preview(step)}, expected an integer")
    if abs(step) > MAX_STEP:
        raise MetricLogError(f"{where}: not a metric log record: 'step' is {_preview(step)}, "
                             f"beyond any training step (at most {MAX_STEP})")
    return int(step)


def _parse_line(raw_line: bytes, where: str, first: bool) -> dict | None:
    """The record on one line, None for a blank line; MetricLogError naming ``where`` otherwise."""
    try:
        line = raw_line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MetricLogError(f"{where}: not a metric log: not UTF-8 text ({error.reason})") from None
    if first:
        line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not line.strip():
        return None
    try:
        # parse_constant: the NaN/Infinity literals Python's json writes, kept apart from overflow.
        record = json.loads(line, parse_constant=_literal)
    except json.JSONDecodeError as error:
        raise MetricLogError(f"{where}: not a metric log: invalid JSON ({error.msg})") from None
    except RecursionError:
        raise MetricLogError(f"{where}: not a metric log: JSON nested too deeply to read") from None
    except ValueError as error:  # an integer with more digits than Python converts (4300)
        raise MetricLogError(f"{where}: not a metric log: a number that cannot be read ({error})") from None
    if not isinstance(record, dict):
        raise MetricLogError(f"{where}: not a metric log record: expected a JSON object, got {type(record).__name__}")
    return record


def _read_records(log_path: Path):
    """``(line_number, record)`` for every non-blank line; MetricLogError naming the line otherwise."""
    try:
        handle = open(log_path, "rb")
    except OSError as error:
        raise MetricLogError(f"{log_path}: cannot read: {error.strerror or error}") from None
    with handle:
        line_number = 0
        while True:
            try:
                raw_line = handle.readline(MAX_LINE_BYTES + 1)
            except OSError as error:
                raise MetricLogError(f"{log_path}:{line_number + 1}: cannot read: {error.strerror or error}") from None
            if not raw_line:
                return
            line_number += 1
            if len(raw_line) > MAX_LINE_BYTES:
                raise MetricLogError(f"{log_path}:{line_number}: not a metric log: a line longer than "
                                     f"{MAX_LINE_BYTES // 2**20} MiB")
            record = _parse_line(raw_line, f"{log_path}:{line_number}", line_number == 1)
            if record is not None:
                yield line_number, record


def _same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def read_run_segments(path: str | Path, label: str | None = None) -> list[RunLog]:
    """Read a log as one run per segment of non-decreasing steps; MetricLogError naming file:line on a bad line."""
    log_path = resolve_log_path(path)
    label = label or log_path.stem
    runs: list[RunLog] = []
    restarts: list[str] = []
    run: RunLog | None = None
    last_step: int | None = None
    last_line = 0
    lines_of_step: dict[str, int] = {}  # key -> line that set it, for the step being merged
    for line_number, record in _read_records(log_path):
        where = f"{log_path}:{line_number}"
        step = _step_of(record, where)
        if run is None or step < last_step:
            if run is not None:
                run.lines = (run.lines[0], last_line)
                restarts.append(f"{where}: step {step} follows step {last_step} (line {last_line})")
                if len(restarts) >= MAX_RUNS_PER_FILE:
                    raise MetricLogError(
                        f"{restarts[0]}; steps go back {len(restarts)} times by line {line_number}: more than "
                        f"{MAX_RUNS_PER_FILE} runs in one file reads as steps out of order; sort the file, or split "
                        "it into one file per run")
            run = RunLog(label=label, path=log_path, lines=(line_number, line_number))
            runs.append(run)
        if step != last_step:
            lines_of_step = {}
        last_step, last_line = step, line_number
        if set(record) == {"step", "data"} and isinstance(record["data"], dict):
            run.formats.add(VERL_FILE_FORMAT)
            metrics = record["data"]
        else:
            run.formats.add(PLAIN_JSONL_FORMAT)
            metrics = {key: value for key, value in record.items() if key != "step"}
        merged = run.metrics_by_step.setdefault(step, {})
        for key, value in metrics.items():
            kind = type(value)
            if kind is float:
                number = value
                if (number - number) != 0.0:  # inf not written as a literal: an overflowing number
                    _refuse_number(value, key, where)
            elif kind is _Literal:
                number = float(value)
            elif kind is int:
                number = _int_metric(value, key, where)
            elif value is None:
                number = None
            else:  # strings, booleans, lists, objects: present, but not a per-update number
                run.not_numbers.setdefault(key, Occurrences()).add(f"{where}: {_preview(value)}")
                continue
            if key in merged and not _same(merged[key], number):
                run.conflicts.setdefault(key, Occurrences()).add(
                    f"{where}: step {step} again, {_preview(number)} after {_preview(merged[key])} "
                    f"(line {lines_of_step.get(key, '?')})")
            merged[key] = number  # a later record for the same step and key wins
            lines_of_step[key] = line_number
    if run is None:
        raise MetricLogError(f"{log_path}: not a metric log: no records (the file is empty or blank)")
    run.lines = (run.lines[0], last_line)
    if len(runs) > 1:
        for index, segment in enumerate(runs, start=1):
            segment.label = f"{label}[{index}]"
            segment.segment = (index, len(runs))
        parts = ", ".join(f"{r.label} (lines {r.lines[0]}-{r.lines[1]})" for r in runs)
        runs[0].warnings.append(
            f"{log_path} holds {len(runs)} runs: steps go back at " + "; ".join(restarts)
            + f". Each run is reported on its own: {parts}")
    return runs


def read_metric_log(path: str | Path, label: str | None = None) -> RunLog:
    """Read one run's log; raise ``MetricLogError`` naming the file and line on anything else,
    including a file that holds several runs (``read_run_segments`` reads those)."""
    runs = read_run_segments(path, label)
    if len(runs) > 1:
        raise MetricLogError(runs[0].warnings[0].split(". Each run")[0] + ": read it with read_run_segments")
    return runs[0]


def parse_run_argument(argument: str) -> tuple[str | None, str]:
    """``LABEL=PATH`` names a run; a plain path (or one that exists as given) is labelled by its stem."""
    label, separator, path = argument.partition("=")
    if separator and label and "/" not in label and not Path(argument).exists():
        if not path:
            raise MetricLogError(f"{argument}: LABEL=PATH with an empty PATH: name the run's metric log after '='")
        return label, path
    return None, argument
