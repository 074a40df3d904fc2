"""The zygote the main_ppo tests fork their Ray workers from (``support/ray_worker_zygote.py``):
a client's program runs as it would have run itself (arguments, environment, directory, streams,
exit status), and no forked worker outlives its client or the zygote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.ray_worker_zygote import SCRIPT, ZYGOTE_READY

SUPPORT = os.path.dirname(SCRIPT)


@pytest.fixture
def zygote(tmp_path):
    """A zygote that preloads nothing (the behaviour does not depend on what it imported): its socket."""
    socket_path = str(tmp_path / "workers")
    server = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {SUPPORT!r}); import ray_worker_zygote as z; "
                               f"z.serve({socket_path!r}, preload=())"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert server.stdout.readline().startswith(ZYGOTE_READY)
    yield socket_path, server
    server.kill()
    server.wait()


def _client(socket_path: str, *worker_argv: str, **options) -> subprocess.Popen:
    """As Ray would exec it: the interpreter without site packages, the zygote's path, the worker's argv."""
    return subprocess.Popen([sys.executable, "-S", SCRIPT, socket_path, *worker_argv], **options)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (the zygote has not reaped it yet) is gone too.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_forked_worker_runs_as_the_client_would_have_and_returns_its_status(zygote, tmp_path):
    socket_path, _ = zygote
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\n"
                      "print(sys.argv[1:], os.getcwd(), os.environ['WORKER_SETTING'], __name__, sys.path[0])\n"
                      "print('to stderr', file=sys.stderr)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    done = _client(socket_path, str(script), "3", "--flag", cwd=workdir, env={**os.environ, "WORKER_SETTING": "x1"},
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = done.communicate(timeout=60)
    assert done.returncode == 3, (out, err)
    assert out.split() == ["['3',", "'--flag']", str(workdir), "x1", "__main__", str(tmp_path)]
    assert err == "to stderr\n"


def test_a_worker_that_raises_exits_1_with_its_traceback(zygote, tmp_path):
    socket_path, _ = zygote
    script = tmp_path / "worker.py"
    script.write_text("raise ValueError('worker failed')\n")
    done = _client(socket_path, str(script), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = done.communicate(timeout=60)
    assert done.returncode == 1 and "ValueError: worker failed" in err and "Traceback" in err


def _sleeping_worker(socket_path: str, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    script, pid_file = tmp_path / "sleeper.py", tmp_path / "pid"
    script.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    client = _client(socket_path, str(script))
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and client.poll() is None
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    assert worker != client.pid and not _gone(worker)
    # A process group of its own, as Ray starts a worker (Ray's cleanup kills a worker's group).
    assert os.getpgid(worker) == worker
    return client, worker


def _wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_killed_client_takes_its_worker_with_it(zygote, tmp_path):
    """Ray (or a run's timeout) kills the process it started, the client: the worker goes too."""
    socket_path, _ = zygote
    client, worker = _sleeping_worker(socket_path, tmp_path)
    client.kill()
    client.wait()
    assert _wait_gone(worker)


def test_a_killed_worker_ends_its_client_with_the_signal_status(zygote, tmp_path):
    """Ray kills the pid the worker registered with, the forked one: its client exits 128 + signal."""
    socket_path, _ = zygote
    client, worker = _sleeping_worker(socket_path, tmp_path)
    os.kill(worker, signal.SIGKILL)
    assert client.wait(timeout=30) == 128 + signal.SIGKILL


def test_a_terminated_zygote_kills_every_worker_it_forked(zygote, tmp_path):
    """What the tests do after a run: the zygote's workers, each in a group of its own, do not outlive it."""
    socket_path, server = zygote
    client, worker = _sleeping_worker(socket_path, tmp_path)
    os.kill(server.pid, signal.SIGTERM)
    server.wait(timeout=30)
    assert _wait_gone(worker)
    assert client.wait(timeout=30) != 0


def test_a_client_that_dies_while_asking_leaves_the_zygote_serving_the_next(zygote, tmp_path):
    import socket

    socket_path, server = zygote
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(socket_path)
    half.sendall(b"\x00\x00\x10\x00{")  # a header promising 4096 bytes, then gone
    half.close()
    script = tmp_path / "worker.py"
    script.write_text("raise SystemExit(5)\n")
    assert _client(socket_path, str(script)).wait(timeout=60) == 5
    assert server.poll() is None
