"""Hostile metric logs given to ``zmrl report``.

Each case runs the command line as a user would. A line that cannot be a metric log is refused
(exit 2) naming it as ``file:line``; values that are logged but are not finite numbers are
shown where they occur, and a file holding several runs is reported one run per segment, saying
so. Where the report is produced, the table or its JSON (``--json -``) is checked.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import tempfile
from pathlib import Path

from support.bad_input import error, result, run_cli

DOC = "docs/diagnostics.md, section 'Which logs it reads'"


@functools.cache
def _workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="zmrl-bad-report-"))


def log(name: str, *lines) -> str:
    """A log file of ``lines``: dicts are written as JSON, strings as they are (bytes: raw)."""
    path = _workdir() / name
    if lines and all(isinstance(line, bytes) for line in lines):
        path.write_bytes(b"".join(lines))
    else:
        path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def report(*args):
    return lambda: run_cli(["report", *(a() if callable(a) else a for a in args)])


def report_json(*args):
    """``zmrl report ARGS --json -``: the exit code must be 0; the value is the parsed report."""
    def run():
        outcome = run_cli(["report", *(a() if callable(a) else a for a in args), "--json", "-"])
        assert outcome.code == 0, f"exit {outcome.code}: {outcome.err}"
        return json.loads(outcome.out)  # the NaN/Infinity literals Python's json writes are read back

    return run


def report_text(*args):
    def run():
        outcome = run_cli(["report", *(a() if callable(a) else a for a in args)])
        assert outcome.code == 0, f"exit {outcome.code}: {outcome.err}"
        return outcome.out

    return run


def row(text: str, title: str) -> list[str]:
    """The cells of the table row ``title`` (columns are two or more spaces apart)."""
    lines = [line for line in text.splitlines() if line.startswith(title)]
    assert lines, f"the table has no row {title!r}"
    line = lines[0]
    return [cell for cell in re.split(r"\s{2,}", line[len(title):].strip()) if cell]


def in_directory(make_directory, argv):
    """``zmrl report argv`` run from inside the directory ``make_directory()`` returns."""
    def run():
        with contextlib.chdir(make_directory()):
            return run_cli(["report", *argv])

    return run


def cwd_with_one_log() -> Path:
    """A working directory holding one log, which an empty PATH must not silently pick up."""
    path = _workdir() / "cwd-with-one-log"
    path.mkdir(exist_ok=True)
    (path / "stray.jsonl").write_text('{"step": 1, "actor/grad_norm": 1.0}\n')
    return path


def dir_whose_jsonl_is_a_directory() -> str:
    path = _workdir() / "run-dir"
    (path / "exp.jsonl").mkdir(parents=True, exist_ok=True)
    return str(path)


def fifo() -> str:
    path = _workdir() / "pipe.jsonl"
    if not path.exists():
        os.mkfifo(path)
    return str(path)


def unreadable() -> str:
    """A regular file whose read fails: mode 000, or where permissions do not bind (root) one
    whose read is an I/O error (/proc/self/mem at offset 0)."""
    path = _workdir() / "unreadable.jsonl"
    if not os.path.lexists(path):
        if os.geteuid() != 0:
            path.write_text('{"step": 1}\n')
            path.chmod(0)
        else:
            path.symlink_to("/proc/self/mem")
    return str(path)


def d3(value, step=None):
    return {"step": step, "actor/rollout_corr/k3_kl": value}


D3 = "actor/rollout_corr/k3_kl"


# ---------------------------------------------------------------- checks of produced reports


def _infinite_peak(report):
    d3_figures = report["runs"]["d3-inf"]["d3"]
    assert d3_figures["peak"] == float("inf") and d3_figures["peak_step"] == 2, d3_figures
    assert d3_figures["peak_to_median"] == float("inf") and d3_figures["non_finite_counts"] == {"inf": 1}, d3_figures


def _infinite_peak_in_table(text):
    assert row(text, "D3 peak @step") == ["inf @2"], row(text, "D3 peak @step")
    assert row(text, "D3 peak / median") == ["inf"]


def _only_infinite(text):
    assert row(text, "D3 peak @step") == ["inf @1"], row(text, "D3 peak @step")
    assert row(text, "D3 non-finite updates") == ["2 (2 inf)"], row(text, "D3 non-finite updates")


def _nan_shown(text):
    assert row(text, "D3 non-finite updates") == ["1 (1 NaN)"], row(text, "D3 non-finite updates")
    assert "NaN at step 2" in text


def _grad_norm_infinite_max(report):
    grad = report["runs"]["grad-inf"]["grad_norm"]
    assert (grad["max"], grad["max_step"]) == (float("inf"), 3), grad


def _string_is_not_a_number(text):
    assert row(text, "D3 peak @step") == ["not a number"], row(text, "D3 peak @step")
    assert "present but not a number" in text and 'd3-str.jsonl:1: "0.5"' in text, text


def _string_on_one_line(report):
    figures = report["runs"]["d3-str-once"]["d3"]
    assert figures["status"] == "ok" and figures["updates"] == 2, figures
    assert any('d3-str-once.jsonl:2: "0.9"' in note for note in figures["notes"]), figures["notes"]


def _boolean_is_not_a_number(report):
    figures = report["runs"]["grad-bool"]["grad_norm"]
    assert figures["status"] == "not a number", figures
    assert any("grad-bool.jsonl:1: true" in note for note in figures["notes"]), figures["notes"]


def _two_runs(report):
    assert list(report["runs"]) == ["two-runs[1]", "two-runs[2]"], list(report["runs"])
    first, second = report["runs"]["two-runs[1]"], report["runs"]["two-runs[2]"]
    assert (first["first_step"], first["last_step"], first["lines"]) == (1, 3, [1, 3])
    assert (second["first_step"], second["last_step"], second["lines"]) == (1, 2, [4, 5])
    assert first["d3"]["peak"] == 0.3 and second["d3"]["peak"] == 0.9
    assert any("two-runs.jsonl:4: step 1 follows step 3" in w for w in report["warnings"]), report["warnings"]


def _resumed_run_in_table(text):
    assert "WARNING: " in text and "resumed.jsonl:5: step 3 follows step 4" in text, text
    assert row(text, "steps logged") == ["4", "4"], row(text, "steps logged")


def _conflicting_duplicate(report):
    figures = report["runs"]["dup-step"]["d3"]
    assert figures["peak"] == 5.0, figures  # the later value, as documented
    assert any("dup-step.jsonl:3: step 2 again, 5.0 after 1.0 (line 2)" in note for note in figures["notes"]), \
        figures["notes"]


def _bom_is_read(report):
    assert report["runs"]["bom"]["d3"]["peak"] == 0.5, report["runs"]["bom"]


CASES = [
    # ------------------------------------------------------------ non-finite values are shown
    result("d3-infinity-is-the-peak",
           report_json(lambda: log("d3-inf.jsonl", d3(0.5, 1), '{"step": 2, "%s": Infinity}' % D3, d3(0.25, 3))),
           _infinite_peak, DOC),
    result("d3-infinity-is-the-peak-in-the-table",
           report_text(lambda: log("d3-inf-t.jsonl", d3(0.5, 1), '{"step": 2, "%s": Infinity}' % D3, d3(0.25, 3))),
           _infinite_peak_in_table, DOC),
    result("d3-only-infinity-still-has-a-peak",
           report_text(lambda: log("d3-only-inf.jsonl", *('{"step": %d, "%s": Infinity}' % (s, D3) for s in (1, 2)))),
           _only_infinite, DOC),
    result("d3-nan-is-counted-and-shown",
           report_text(lambda: log("d3-nan.jsonl", d3(0.5, 1), '{"step": 2, "%s": NaN}' % D3, d3(0.25, 3))),
           _nan_shown, DOC),
    result("grad-norm-infinity-is-the-max",
           report_json(lambda: log("grad-inf.jsonl", {"step": 1, "actor/grad_norm": 2.0},
                                   {"step": 2, "actor/grad_norm": 1.0}, '{"step": 3, "actor/grad_norm": Infinity}')),
           _grad_norm_infinite_max, DOC),
    # ------------------------------------------------------------ numbers no float holds: refused
    error("metric-1e999-written-literally",
          report(lambda: log("e999.jsonl", d3(0.5, 1), '{"step": 2, "actor/grad_norm": 1e999}')),
          r"e999\.jsonl:2: .*'actor/grad_norm' is a number beyond the float range"),
    error("metric-integer-beyond-float-range",
          report(lambda: log("bigint.jsonl", '{"step": 1, "actor/grad_norm": %s}' % ("9" * 400))),
          r"bigint\.jsonl:1: .*'actor/grad_norm' is an integer of 400 digits, beyond the float range"),
    error("metric-integer-with-5000-digits",
          report(lambda: log("digits.jsonl", d3(0.5, 1), '{"step": 2, "a": %s}' % ("7" * 5000))),
          r"digits\.jsonl:2: not a metric log: a number that cannot be read"),
    error("step-integer-beyond-any-step",
          report(lambda: log("bigstep.jsonl", '{"step": %s, "a": 1.0}' % ("9" * 400))),
          r"bigstep\.jsonl:1: .*'step' is 9+\.\.\., beyond any training step"),
    error("deeply-nested-json",
          report(lambda: log("deep.jsonl", d3(0.5, 1), '{"step": 2, "a": %s%s}' % ("[" * 100_000, "]" * 100_000))),
          r"deep\.jsonl:2: not a metric log: JSON nested too deeply"),
    # ------------------------------------------------------------ present, but not a number
    result("d3-logged-as-a-string", report_text(lambda: log("d3-str.jsonl", d3("0.5", 1))),
           _string_is_not_a_number, DOC),
    result("d3-a-string-on-one-line",
           report_json(lambda: log("d3-str-once.jsonl", d3(0.5, 1), d3("0.9", 2), d3(0.25, 3))),
           _string_on_one_line, DOC),
    result("grad-norm-logged-as-a-boolean",
           report_json(lambda: log("grad-bool.jsonl", {"step": 1, "actor/grad_norm": True})),
           _boolean_is_not_a_number, DOC),
    # ------------------------------------------------------------ several runs, duplicate steps
    result("two-runs-in-one-log",
           report_json(lambda: log("two-runs.jsonl", d3(0.1, 1), d3(0.2, 2), d3(0.3, 3), d3(0.9, 1), d3(0.8, 2))),
           _two_runs, DOC),
    result("resumed-run-appended-in-verl-format",
           report_text(lambda: log("resumed.jsonl",
                                   *({"step": s, "data": {D3: 0.5}} for s in (1, 2, 3, 4, 3, 4, 5, 6)))),
           _resumed_run_in_table, DOC),
    error("steps-out-of-order",
          report(lambda: log("shuffled.jsonl", *(d3(0.5, s) for s in range(12, 0, -1)))),
          r"shuffled\.jsonl:2: step 11 follows step 12.*steps go back 8 times.*sort the file"),
    result("one-step-logs-a-key-twice-with-different-values",
           report_json(lambda: log("dup-step.jsonl", d3(0.5, 1), d3(1.0, 2), d3(5.0, 2), d3(0.5, 3))),
           _conflicting_duplicate, DOC),
    # ------------------------------------------------------------ the file itself
    result("byte-order-mark-before-the-first-record",
           report_json(lambda: log("bom.jsonl", b'\xef\xbb\xbf{"step": 1, "actor/rollout_corr/k3_kl": 0.5}\n')),
           _bom_is_read, DOC),
    error("run-directory-whose-log-is-a-directory", report(dir_whose_jsonl_is_a_directory),
          r"run-dir/exp\.jsonl: the run directory's \*\.jsonl is not a file"),
    error("a-fifo-instead-of-a-file", report(fifo), r"pipe\.jsonl: not a regular file"),
    error("unreadable-file", report(unreadable), r"unreadable\.jsonl(:1)?: cannot read"),
    error("label-with-an-empty-path", in_directory(cwd_with_one_log, ["run="]),
          r"run=: LABEL=PATH with an empty PATH"),
    error("an-empty-path", in_directory(cwd_with_one_log, [""]), r"empty path: name a metric log file"),
]
