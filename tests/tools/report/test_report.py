"""`zmrl report`: exact run-level figures from metric logs, verl's own file logger, plots, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zero_mismatch_plugin.tools.cli import main as zmrl
from zero_mismatch_plugin.tools.report import MetricLogError, build_report, load_runs
from zero_mismatch_plugin.tools.report import stats
from zero_mismatch_plugin.tools.report.figures import MISSING
from zero_mismatch_plugin.tools.report.logs import read_metric_log
from zero_mismatch_plugin.tools.report.render import format_report


def _write_verl_file_log(path: Path, records: list[tuple[int, dict]]) -> Path:
    """The line format of verl's FileLogger: {"step": s, "data": {...}} per Tracking.log call."""
    path.write_text("".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in records))
    return path


def _write_plain_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# ---------------------------------------------------------------- statistics by hand


def test_statistics_match_hand_computed_values():
    assert stats.median([3.0, 1.0, 2.0]) == 2.0
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert stats.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert stats.quantile([7.0], 0.5) == 7.0
    assert stats.peak_to_median([1.0, 2.0, 2.0, 2.0, 300.0]) == 150.0
    # A zero median (bit-exact synchronous training) or a negative k1 KL has no ratio.
    assert stats.peak_to_median([0.0, 0.0, 5.0]) is None
    assert stats.safe_ratio(2.0, -1.0) is None
    assert stats.safe_ratio(-2.0, 1.0) is None
    assert stats.integer_counts([2.0, 3.0, 2.0]) == {2: 2, 3: 1}
    assert stats.integer_counts([2.5]) is None
    with pytest.raises(ValueError):
        stats.median([])


@pytest.mark.parametrize(
    "length,requested,expected",
    [(5000, 1000, 1000), (2000, 1000, 1000), (1999, 1000, 999), (10, 1000, 5), (3, 1000, 1), (1, 1000, 1), (10, 2, 2)],
)
def test_window_shrinks_to_half_the_run_so_windows_never_overlap(length, requested, expected):
    assert stats.effective_window(length, requested) == expected
    first, last, window = stats.first_and_last_window(list(range(length)), requested)
    assert window == expected and len(first) == len(last) == expected
    if length > 1:
        assert max(first) < min(last)


# ---------------------------------------------------------------- exact figures from a synthetic run


def _synthetic_run(tmp_path: Path) -> Path:
    """400 updates whose every figure is known in closed form (window 100).

    D3: 0.25 everywhere except 64.0 at step 250 -> median 0.25, peak 64, peak/median 256.
    KL: 0.125 in steps 1-100, 1.0 in the middle, 2.0 in steps 301-400 -> last/first 16
        (a window that reached into the middle would give a different median).
    Rejection: 0 in the first window, 0.5 on every other step of the last window -> 0.25.
    Grad norm: 0.05 except 38.25 at step 123 and a NaN at step 7 (logged as null by verl).
    Bitwise-equal: 1.0 except 0.5 at step 42. Reward: 0.25 first window, 0.75 last window.
    """
    records: list[tuple[int, dict]] = [(0, {"val-core/acc": 0.1})]  # validation before training
    for step in range(1, 401):
        kl = 0.125 if step <= 100 else (2.0 if step > 300 else 1.0)
        rejected = 0.0 if step <= 300 else (0.5 if step % 2 else 0.0)
        data = {
            "actor/rollout_corr/k3_kl": 64.0 if step == 250 else 0.25,
            "actor/rollout_corr/kl": kl,
            "actor/grad_norm": None if step == 7 else (38.25 if step == 123 else 0.05),
            "actor/rollout_corr/rollout_rs_seq_masked_fraction": rejected,
            "actor/zero_mismatch/bitwise_equal_fraction": 0.5 if step == 42 else 1.0,
            "critic/score/mean": 0.25 if step <= 100 else (0.75 if step > 300 else 0.5),
            "training/off_policy/trajectory_staleness/mean": 1.5,
            "training/off_policy/trajectory_staleness/max": 2 if step % 4 else 3,
            "training/off_policy/trajectory_staleness_worst/max": 4,
            "timing_s/step": 1.0,
        }
        records.append((step, data))
        if step % 100 == 0:
            records.append((step, {"val-core/acc": 0.5}))  # a second record at the same step
    return _write_verl_file_log(tmp_path / "synthetic.jsonl", records)


def test_synthetic_verl_log_gives_exact_figures(tmp_path):
    run = read_metric_log(_synthetic_run(tmp_path))
    report = build_report([run], window=100)["runs"]["synthetic"]

    assert report["steps_logged"] == 401 and report["first_step"] == 0 and report["last_step"] == 400
    d3 = report["d3"]
    assert (d3["median"], d3["peak"], d3["peak_step"], d3["peak_to_median"]) == (0.25, 64.0, 250, 256.0)
    assert d3["source"] == "actor/rollout_corr/k3_kl" and d3["updates"] == 400

    kl = report["kl"]
    assert (kl["first_window_median"], kl["last_window_median"], kl["last_over_first"]) == (0.125, 2.0, 16.0)
    assert kl["window"] == 100 and kl["first_window_steps"] == [1, 100] and kl["last_window_steps"] == [301, 400]

    grad = report["grad_norm"]
    assert (grad["max"], grad["max_step"], grad["non_finite"], grad["updates"]) == (38.25, 123, 1, 399)

    rejection = report["rejection"]
    assert (rejection["first_window"], rejection["last_window"]) == (0.0, 0.25)

    bitwise = report["bitwise_equal"]
    assert (bitwise["min"], bitwise["min_step"], bitwise["updates_fully_equal"]) == (0.5, 42, 399)

    reward = report["reward"]
    assert (reward["first_window"], reward["last_window"]) == (0.25, 0.75)

    lag = report["lag"]
    assert lag["mean_per_update"] == {"median": 1.5, "p90": 1.5, "max": 1.5}
    assert lag["max_per_update"]["counts"] == {2: 300, 3: 100} and lag["max_per_update"]["max"] == 3
    assert lag["worst_case_max"] == 4
    assert lag["source"]["max_per_update"] == "training/off_policy/trajectory_staleness/max"

    # The validation record written separately at step 100 was merged, not lost or double-counted.
    assert run.metrics_by_step[100]["val-core/acc"] == 0.5
    assert run.metrics_by_step[100]["actor/rollout_corr/kl"] == 0.125


def test_text_report_names_the_key_of_every_figure(tmp_path):
    text = format_report(build_report(load_runs([str(_synthetic_run(tmp_path))]), window=100))
    assert "256.00x" in text and "16.00x" in text and "25.00%" in text
    for key in (
        "actor/rollout_corr/k3_kl",
        "actor/rollout_corr/kl",
        "actor/grad_norm",
        "actor/rollout_corr/rollout_rs_seq_masked_fraction",
        "actor/zero_mismatch/bitwise_equal_fraction",
        "training/off_policy/trajectory_staleness/max",
        "critic/score/mean",
    ):
        assert key in text


def test_short_run_shrinks_the_window_and_says_so(tmp_path):
    records = [{"step": s, "actor/rollout_corr/kl": float(s)} for s in range(1, 11)]
    run = read_metric_log(_write_plain_jsonl(tmp_path / "short.jsonl", records))
    kl = build_report([run], window=1000)["runs"]["short"]["kl"]
    # 10 updates -> window 5: medians of 1..5 and 6..10.
    assert (kl["window"], kl["first_window_median"], kl["last_window_median"]) == (5, 3.0, 8.0)
    assert kl["last_over_first"] == pytest.approx(8.0 / 3.0)
    assert any("shrunk from 1000 to 5" in note for note in kl["notes"])


# ---------------------------------------------------------------- key recognition


def test_plain_jsonl_with_verl_driver_side_names_is_recognised(tmp_path):
    """A run without the plugin: verl's decoupled-mode names, no actor/ prefix, admitted -> rejected."""
    records = [
        {"step": s, "rollout_corr/k3_kl": 0.5 if s == 3 else 0.125, "rollout_corr/kl": 0.25, "grad_norm": 0.5,
         "flash_reinforce/admitted_fraction": 0.75}
        for s in range(1, 5)
    ]
    run = read_metric_log(_write_plain_jsonl(tmp_path / "driver.jsonl", records))
    assert run.formats == {"jsonl"}
    report = build_report([run], window=2)["runs"]["driver"]
    assert report["d3"]["source"] == "rollout_corr/k3_kl" and report["d3"]["peak_to_median"] == 4.0
    assert report["kl"]["source"] == "rollout_corr/kl" and report["kl"]["last_over_first"] == 1.0
    assert report["grad_norm"]["source"] == "grad_norm"
    assert report["rejection"]["source"] == "1 - flash_reinforce/admitted_fraction"
    assert report["rejection"]["last_window"] == 0.25


def test_actor_side_key_is_preferred_and_the_other_is_listed_not_mixed(tmp_path):
    records = [
        {"step": s, "actor/rollout_corr/k3_kl": 1.0, "rollout_corr/k3_kl": 100.0 if s == 2 else 1.0}
        for s in range(1, 4)
    ]
    d3 = build_report([read_metric_log(_write_plain_jsonl(tmp_path / "both.jsonl", records))])["runs"]["both"]["d3"]
    assert d3["source"] == "actor/rollout_corr/k3_kl"
    assert d3["also_present"] == ["rollout_corr/k3_kl"]
    assert d3["peak"] == 1.0  # the driver-side spike did not leak in


def test_same_version_bitwise_fraction_is_preferred_over_the_lag_including_one(tmp_path):
    # At lag > 0 the loss compares pi_current with mu, so its fraction is 0 even with aligned
    # kernels; the fraction over tokens scored with their own sampling weights is the kernel signal.
    records = [{"step": s, "actor/zero_mismatch/bitwise_equal_fraction": 0.0,
                "demo/own_version/bitwise_equal_fraction": 1.0} for s in range(1, 4)]
    run = read_metric_log(_write_plain_jsonl(tmp_path / "lagged.jsonl", records))
    bitwise = build_report([run])["runs"]["lagged"]["bitwise_equal"]
    assert bitwise["source"] == "demo/own_version/bitwise_equal_fraction"
    assert bitwise["min"] == 1.0


# ---------------------------------------------------------------- missing and non-finite


def test_missing_metrics_are_reported_missing_never_zero(tmp_path, capsys):
    path = _write_plain_jsonl(tmp_path / "gradonly.jsonl", [{"step": s, "actor/grad_norm": 1.0} for s in range(3)])
    report = build_report([read_metric_log(path)])["runs"]["gradonly"]
    for quantity in ("d3", "kl", "rejection", "bitwise_equal", "lag", "reward"):
        assert report[quantity]["status"] == MISSING
        assert report[quantity]["looked_for"]
    assert report["d3"]["peak_to_median"] is None and report["kl"]["last_over_first"] is None
    assert report["rejection"]["last_window"] is None and report["bitwise_equal"]["min"] is None

    assert zmrl(["report", str(path)]) == 0
    text = capsys.readouterr().out
    d3_row = next(line for line in text.splitlines() if line.startswith("D3 peak / median"))
    assert d3_row.split()[-1] == "missing"
    rejection_row = next(line for line in text.splitlines() if line.startswith("rejected seqs, last window"))
    assert rejection_row.split()[-1] == "missing"


def test_non_finite_values_are_counted_and_shown(tmp_path):
    # Python's json writes NaN/Infinity literals; verl's orjson writes null. All three are counted
    # by kind and left out of the median; an Infinity is the max, never hidden behind a finite one.
    path = tmp_path / "nan.jsonl"
    path.write_text(
        '{"step": 1, "actor/grad_norm": 2.0}\n'
        '{"step": 2, "actor/grad_norm": NaN}\n'
        '{"step": 3, "actor/grad_norm": Infinity}\n'
        '{"step": 4, "actor/grad_norm": null}\n'
        '{"step": 5, "actor/grad_norm": 1.0, "note": "text values are ignored"}\n'
    )
    grad = build_report([read_metric_log(path)])["runs"]["nan"]["grad_norm"]
    assert (grad["max"], grad["max_step"], grad["updates"], grad["non_finite"]) == (math.inf, 3, 2, 3)
    assert grad["median"] == 1.5 and grad["non_finite_counts"] == {"null": 1, "NaN": 1, "inf": 1}
    assert any("NaN at step 2" in note and "inf at step 3" in note for note in grad["notes"])


def test_a_quantity_logged_only_as_non_finite_is_not_a_number(tmp_path):
    path = _write_plain_jsonl(tmp_path / "allnan.jsonl", [{"step": 1, "actor/rollout_corr/k3_kl": None}])
    d3 = build_report([read_metric_log(path)])["runs"]["allnan"]["d3"]
    assert d3["status"] == "no finite values" and d3["peak_to_median"] is None and d3["non_finite"] == 1


# ---------------------------------------------------------------- not a metric log


@pytest.mark.parametrize(
    "content,line,reason",
    [
        ('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a": \n', 3, "invalid JSON"),
        ("step,kl\n1,0.5\n", 1, "invalid JSON"),
        ('{"step": 1, "a": 1.0}\n[1, 2]\n', 2, "expected a JSON object"),
        ('{"step": 1, "a": 1.0}\n\n{"a": 2.0}\n', 3, "no 'step' key"),
        ('{"step": "one", "a": 1.0}\n', 1, "expected an integer"),
    ],
)
def test_a_file_that_is_not_a_metric_log_is_an_error_naming_file_and_line(tmp_path, capsys, content, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(MetricLogError) as error:
        read_metric_log(path)
    assert f"{path}:{line}:" in str(error.value) and reason in str(error.value)

    assert zmrl(["report", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"{path}:{line}:" in captured.err and captured.out == ""


def test_empty_file_and_ambiguous_directory_are_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(MetricLogError, match="no records"):
        read_metric_log(empty)
    (tmp_path / "other.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(MetricLogError, match="exactly one"):
        read_metric_log(tmp_path)


def test_a_file_holding_two_runs_is_read_per_run_and_said_so(tmp_path):
    path = _write_plain_jsonl(tmp_path / "both.jsonl",
                              [{"step": s, "actor/grad_norm": 1.0} for s in (1, 2, 3)]
                              + [{"step": s, "actor/grad_norm": 2.0} for s in (2, 3)])
    with pytest.raises(MetricLogError, match=rf"{path}:4: step 2 follows step 3 \(line 3\)"):
        read_metric_log(path)
    first, second = load_runs([f"run={path}"])
    assert (first.label, first.lines, first.steps) == ("run[1]", (1, 3), [1, 2, 3])
    assert (second.label, second.lines, second.steps) == ("run[2]", (4, 5), [2, 3])
    report = build_report([first, second])
    assert report["runs"]["run[2]"]["segment"] == {"index": 2, "of": 2}
    text = format_report(report)
    assert text.splitlines()[2].startswith("WARNING: ") and "lines 4-5: run 2 of 2" in text


def test_an_overlong_line_is_refused_before_parsing(tmp_path, monkeypatch):
    from zero_mismatch_plugin.tools.report import logs

    monkeypatch.setattr(logs, "MAX_LINE_BYTES", 64)
    path = tmp_path / "long.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "a": "' + "x" * 100 + '"}\n')
    with pytest.raises(MetricLogError, match=rf"{path}:2: not a metric log: a line longer than"):
        read_metric_log(path)


# ---------------------------------------------------------------- verl's own file logger


def test_log_written_by_verls_tracking_file_backend_is_read(tmp_path, monkeypatch):
    """Write a log through verl.utils.tracking.Tracking(backend='file') on CPU and read it back."""
    np = pytest.importorskip("numpy")
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    tracker = Tracking(project_name="proj", experiment_name="exp", default_backend="file")
    tracker.log(data={"val-core/acc": np.float64(0.25)}, step=0)
    for step in range(1, 9):
        tracker.log(
            data={
                "actor/rollout_corr/k3_kl": np.float32(8.0 if step == 5 else 0.5),
                "actor/rollout_corr/kl": np.float64(0.25 if step <= 4 else 1.0),
                "actor/grad_norm": float("nan") if step == 2 else np.float64(step),
                "critic/score/mean": np.float64(step / 8),
                "training/off_policy/trajectory_staleness/max": np.int64(step % 3),
            },
            step=step,
        )
    tracker.finish()

    log_path = tmp_path / "proj" / "exp.jsonl"
    first_line = json.loads(log_path.read_text().splitlines()[0])
    assert first_line == {"step": 0, "data": {"val-core/acc": 0.25}}  # the format the reader relies on

    run = read_metric_log(tmp_path / "proj")  # verl's <root>/<project>/ directory
    assert run.path == log_path and run.formats == {"verl-file"} and run.label == "exp"
    report = build_report([run], window=4)["runs"]["exp"]
    assert (report["d3"]["peak"], report["d3"]["peak_step"], report["d3"]["peak_to_median"]) == (8.0, 5, 16.0)
    assert report["kl"]["last_over_first"] == 4.0 and report["kl"]["window"] == 4
    assert (report["grad_norm"]["max"], report["grad_norm"]["non_finite"]) == (8.0, 1)  # NaN was written as null
    assert (report["reward"]["first_window"], report["reward"]["last_window"]) == (0.3125, 0.8125)
    assert report["lag"]["max_per_update"]["counts"] == {0: 2, 1: 3, 2: 3}


# ---------------------------------------------------------------- plots


def _two_runs(tmp_path: Path):
    aligned = [
        {"step": s, "actor/rollout_corr/k3_kl": 1e-4 * (1 + (s % 5) / 10), "actor/rollout_corr/kl": 1e-4,
         "critic/score/mean": 0.3 + s / 1000}
        for s in range(1, 301)
    ]
    standard = [
        {"step": s, "rollout_corr/k3_kl": 1e-3 * (50 if s % 97 == 0 else 1) * (1 + s / 100),
         "rollout_corr/kl": 1e-4 * (1 + s / 10), "critic/score/mean": 0.3 + s / 3000,
         "rollout_corr/rollout_rs_seq_masked_fraction": min(0.5, s / 600)}
        for s in range(1, 301)
    ]
    return load_runs([
        f"aligned={_write_plain_jsonl(tmp_path / 'a.jsonl', aligned)}",
        f"standard={_write_plain_jsonl(tmp_path / 'b.jsonl', standard)}",
    ])


def test_each_figure_overlays_every_run_with_labels(tmp_path):
    import matplotlib.pyplot as plt

    from zero_mismatch_plugin.tools.report.plots import PLOTS, draw_quantity

    runs = _two_runs(tmp_path)
    specs = {spec.filename: spec for spec in PLOTS}
    figure = draw_quantity(runs, specs["d3.png"])
    axes = figure.axes[0]
    labels = axes.get_legend_handles_labels()[1]
    assert axes.get_yscale() == "log"
    assert any(l.startswith("aligned") and "actor/rollout_corr/k3_kl" in l for l in labels)
    assert any(l.startswith("standard") and "[rollout_corr/k3_kl]" in l for l in labels)
    assert axes.get_title() and axes.get_xlabel() == "training step"
    plt.close(figure)

    figure = draw_quantity(runs, specs["rejection.png"])
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert "aligned: not logged" in labels  # absent, and visibly so
    plt.close(figure)


def test_plots_are_written_as_non_empty_pngs(tmp_path):
    from matplotlib.image import imread

    from zero_mismatch_plugin.tools.report.plots import write_plots

    written = write_plots(_two_runs(tmp_path), tmp_path / "plots")
    for name in ("d3.png", "kl.png", "reward.png", "rejection.png"):
        path = written[name]
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = imread(path)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 600
        assert pixels[..., :3].std() > 0.05  # not a blank canvas
    assert written["grad_norm.png"] is None and not (tmp_path / "plots" / "grad_norm.png").exists()


# ---------------------------------------------------------------- command line


def test_cli_writes_json_with_the_documented_keys_and_plots(tmp_path, capsys):
    log = _synthetic_run(tmp_path)
    out = tmp_path / "report.json"
    assert zmrl(["report", f"run={log}", str(log), "--window", "100", "--json", str(out),
                 "--plots", str(tmp_path / "plots")]) == 0
    report = json.loads(out.read_text())
    assert list(report["runs"]) == ["run", "synthetic"]
    for run in report["runs"].values():
        assert run["d3"]["peak_to_median"] == 256.0
        assert run["kl"]["last_over_first"] == 16.0
        assert run["grad_norm"]["max"] == 38.25
        assert run["rejection"]["last_window"] == 0.25
        assert run["bitwise_equal"]["min"] == 0.5
    assert (tmp_path / "plots" / "d3.png").stat().st_size > 10_000
    stdout = capsys.readouterr().out
    assert "run" in stdout.splitlines()[2] and "synthetic" in stdout.splitlines()[2]  # side-by-side header


def test_cli_json_on_stdout_is_parseable(tmp_path, capsys):
    log = _write_plain_jsonl(tmp_path / "x.jsonl", [{"step": 1, "actor/rollout_corr/k3_kl": 0.5}])
    assert zmrl(["report", str(log), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runs"]["x"]["d3"]["peak_to_median"] == 1.0
    assert math.isclose(report["runs"]["x"]["d3"]["median"], 0.5)


def test_cli_exit_codes_for_bad_input(tmp_path, capsys):
    assert zmrl(["report", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    log = _write_plain_jsonl(tmp_path / "x.jsonl", [{"step": 1, "a": 1.0}])
    assert zmrl(["report", str(log), "--window", "0"]) == 2
    with pytest.raises(SystemExit) as exit_info:
        zmrl(["report"])
    assert exit_info.value.code == 2
