"""``zmrl demo`` stopped by SIGINT or SIGTERM: one line saying what was kept, the metrics so far on
disk, no traceback, no engine process left behind. The interrupt handling is ``cli``'s one
mechanism, which ``zmrl check`` uses too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support import REPO  # noqa: E402
CLI = "import sys; from zero_mismatch_plugin.tools.cli import main; sys.exit(main())"
START_TIMEOUT_S = 600
EXIT_TIMEOUT_S = 120


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait_for_metrics(process, metrics: Path, stderr: Path) -> list[psutil.Process]:
    """Wait until the demo has logged an update; return its child processes (the engine's)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    children = []
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the demo exited early ({process.returncode}):\n{stderr.read_text()[-3000:]}")
        children = children or psutil.Process(process.pid).children(recursive=True)
        if _lines(metrics):
            return children or psutil.Process(process.pid).children(recursive=True)
        time.sleep(0.5)
    pytest.fail(f"no update logged in {START_TIMEOUT_S} s:\n{stderr.read_text()[-3000:]}")


def test_demo_stopped_by_a_signal_keeps_its_metrics_and_its_engine_is_gone(tmp_path):
    """End to end with SIGTERM (what a scheduler sends). SIGINT goes to the same handler from the
    moment ``cli`` installs it (:func:`test_check_uses_the_same_interrupt_handling` runs both through
    it), so a second demo run for SIGINT would repeat this one's path after the signal number."""
    signum = signal.SIGTERM
    out = tmp_path / "out"
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(stdout, "w") as out_file, open(stderr, "w") as err_file:
        process = subprocess.Popen([sys.executable, "-c", CLI, "demo", "--updates", "1000", "--lag", "1",
                                    "--out", str(out)], stdout=out_file, stderr=err_file, env=env, cwd=tmp_path)
    children = []
    try:
        children = _wait_for_metrics(process, out / "metrics.jsonl", stderr)
        assert children, "the engine runs in a child process"
        process.send_signal(signum)
        code = process.wait(timeout=EXIT_TIMEOUT_S)
    finally:
        for leftover in [*children, psutil.Process(process.pid)] if process.poll() is None else children:
            if leftover.is_running():
                leftover.kill()
    err = stderr.read_text()
    assert code == 128 + signum, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    name = signal.Signals(signum).name
    lines = [line.rsplit("\r", 1)[-1] for line in err.splitlines()]
    stopped = [line for line in lines if line.startswith("zmrl demo: stopped by")]
    assert len(stopped) == 1 and [line for line in lines if line.strip()][-1] == stopped[0], err[-3000:]
    kept = _lines(out / "metrics.jsonl")
    assert kept and all(json.loads(line)["step"] == i for i, line in enumerate(kept, start=1))
    assert stopped[0].startswith(f"zmrl demo: stopped by {name}; ")
    assert f"of 1000 updates done, their metrics kept in {out / 'metrics.jsonl'}" in stopped[0]
    # No engine process left behind, and the output directory is free again (its lock removed).
    time.sleep(1)
    alive = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"engine processes left behind: {alive}"
    assert not (out / ".zmrl-demo.lock").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_check_uses_the_same_interrupt_handling(signum, monkeypatch, capsys):
    """``zmrl check`` interrupted mid-run: the same one line (it keeps nothing: its table and JSON come
    at the end), the exit code of a signalled command, no traceback."""
    from zero_mismatch_plugin.tools import cli

    cleaned = []

    def interrupted_check(args):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the signal arrives here
            return 0
        finally:
            cleaned.append(True)  # an engine's ``with`` block would shut it down here

    monkeypatch.setattr("zero_mismatch_plugin.tools.checker.commands.check_command", interrupted_check)
    previous = signal.getsignal(signum)
    code = cli.main(["check", "--model", "unused"])
    err = capsys.readouterr().err
    assert code == 128 + signum and cleaned == [True]
    assert err.strip().splitlines() == [
        f"zmrl check: stopped by {signal.Signals(signum).name}; nothing was written "
        "(the table and --json come after the last check)"
    ]
    assert signal.getsignal(signum) is previous  # the command's handlers are gone with it
