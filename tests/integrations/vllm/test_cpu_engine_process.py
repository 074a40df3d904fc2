"""ZMRL_CPU_ENGINE_ONE_PROCESS: a CPU engine of world size 1 keeps the uni executor, only with one OMP thread;
ZMRL_CPU_ENGINE_FORK: EngineCores from a fork server, one-thread ranks forked from their EngineCore."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zero_mismatch_plugin.integrations.vllm.cpu_engine_process import _keep_uniprocess_executor


class Platform:
    @classmethod
    def check_and_update_config(cls, vllm_config):  # what vLLM's CPU platform does to "uni"
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            vllm_config.parallel_config.distributed_executor_backend = "mp"


def checked(world_size, backend="uni"):
    config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size, distributed_executor_backend=backend))
    patched = _keep_uniprocess_executor(Platform.__dict__["check_and_update_config"])
    patched.__get__(None, Platform)(config)
    return config.parallel_config.distributed_executor_backend


def test_world_size_one_keeps_the_uniprocess_executor(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert checked(1) == "uni"
    assert checked(2, "mp") == "mp"  # a real multi-worker engine is left alone


@pytest.mark.parametrize("threads", [None, "2"])
def test_more_than_one_thread_is_refused_with_what_to_set(monkeypatch, threads):
    if threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
    with pytest.raises(RuntimeError, match="needs OMP_NUM_THREADS=1 .*set OMP_NUM_THREADS=1, or unset ZMRL_CPU_ENGINE_ONE_PROCESS"):
        checked(1)


def _report_environment(path, name):
    import os

    with open(path, "w") as out:
        out.write(f"{os.environ.get(name)} {os.getpid()}")


def test_fork_server_engine_processes_run_with_the_callers_environment_at_start(tmp_path, monkeypatch):
    """The fork server starts once (in this test or earlier), with the environment of that moment;
    each process it forks runs with the caller's environment of its own start, as a spawned process
    would. A plain fork-server process (the planted fault) keeps the server's."""
    import multiprocessing

    from zero_mismatch_plugin.integrations.vllm.cpu_engine_process import _ENGINE_FORK_SERVER

    seen = {}
    monkeypatch.setenv("ZMRL_TEST_ENGINE_ENV", "before")
    for label, context, value in (("first", _ENGINE_FORK_SERVER, "before"), ("engine", _ENGINE_FORK_SERVER, "after"),
                                  ("plain", multiprocessing.get_context("forkserver"), "after")):
        monkeypatch.setenv("ZMRL_TEST_ENGINE_ENV", value)
        process = context.Process(target=_report_environment, args=(tmp_path / label, "ZMRL_TEST_ENGINE_ENV"))
        process.start()
        process.join(120)
        assert process.exitcode == 0
        seen[label] = (tmp_path / label).read_text().split()[0]
    assert (seen["first"], seen["engine"]) == ("before", "after")
    assert seen["plain"] != "after"  # the server's environment: of its start, here or in an earlier test


@pytest.mark.parametrize("switches,method", [({"ZMRL_CPU_ENGINE_FORK": "1"}, "forkserver"),
                                             ({"ZMRL_CPU_ENGINE_FORK": None}, "spawn")])
def test_the_fork_switch_gives_engine_cores_from_the_fork_server(monkeypatch, switches, method):
    """The plugin applies the fork server's patch with both switches on; the patched context
    replaces vLLM's spawn and leaves another start method alone."""
    import multiprocessing

    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm import plugin
    from zero_mismatch_plugin.integrations.vllm.cpu_engine_process import (FORK_SERVER, FORKED_WORKERS,
                                                                            _engine_cores_from_a_fork_server)

    monkeypatch.setenv("ZMRL_CPU_ENGINE_ONE_PROCESS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name, value in switches.items():
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
    def active(patch):
        return runtime_patches.is_applied(patch) or runtime_patches.is_pending(patch)

    held = {patch: active(patch) for patch in (FORK_SERVER, FORKED_WORKERS)}
    for patch in held:
        runtime_patches.remove(patch)
    try:
        plugin.register()
        assert [active(patch) for patch in held] == [method == "forkserver"] * 2
    finally:
        for patch, was_active in held.items():
            (runtime_patches.apply if was_active else runtime_patches.remove)(patch)
    get_mp_context = _engine_cores_from_a_fork_server(lambda: multiprocessing.get_context("spawn"))
    assert get_mp_context().get_start_method() == "forkserver"
    kept = _engine_cores_from_a_fork_server(lambda: multiprocessing.get_context("fork"))
    assert kept().get_start_method() == "fork"


@pytest.mark.parametrize("threads,binding,method", [
    ("1", "0|1", "fork"), ("1", "0|1|0|1", "fork"),  # one one-thread CPU per rank: forked
    ("1", "0,1|2,3", "spawn"),  # ranks of two CPUs would read their thread count and places at start
    ("1", None, "spawn"), ("1", "auto", "spawn"), ("1", "nobind", "spawn"),  # vLLM picks the CPUs
    ("2", "0|1", "spawn"), (None, "0|1", "spawn"),  # a worker would inherit the wrong thread count
])
def test_workers_are_forked_only_where_each_rank_is_one_thread_on_one_cpu(monkeypatch, threads, binding, method):
    """A forked worker keeps the OpenMP runtime (thread count, no places) of the EngineCore it came
    from; a spawned one reads the per-rank variables vLLM sets. Forking is only the same worker
    where those variables would say one thread."""
    import multiprocessing

    from zero_mismatch_plugin.integrations.vllm.cpu_engine_process import _workers_forked_from_the_engine_core

    for name, value in (("OMP_NUM_THREADS", threads), ("VLLM_CPU_OMP_THREADS_BIND", binding)):
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
    get_mp_context = _workers_forked_from_the_engine_core(lambda: multiprocessing.get_context("spawn"))
    assert get_mp_context().get_start_method() == method
    kept = _workers_forked_from_the_engine_core(lambda: multiprocessing.get_context("forkserver"))
    assert kept().get_start_method() == "forkserver"  # only vLLM's spawn is replaced


# A caller that starts one engine-fork-server process running TARGET of the module in TARGETS_DIR
# (with GRACE seconds between SIGTERM and SIGKILL once the caller is gone), prints its pid, waits.
_CALLER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import fork_server_targets
from zero_mismatch_plugin.integrations.vllm import cpu_engine_process
cpu_engine_process.ORPHAN_SHUTDOWN_S = float(sys.argv[3])
process = cpu_engine_process._ENGINE_FORK_SERVER.Process(target=getattr(fork_server_targets, sys.argv[2]))
process.start()
print(process.pid, flush=True)
time.sleep(600)
"""
_TARGETS = """
import signal, time

def sleeps():
    time.sleep(600)

def ignores_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
"""


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("target,grace_s,within_s", [("sleeps", 30.0, 10.0), ("ignores_sigterm", 2.0, 15.0)])
def test_an_engine_fork_server_process_ends_when_its_caller_is_killed(tmp_path, target, grace_s, within_s):
    """Its parent is the fork server, not the caller: killed outright (SIGKILL, as Ray ends an
    actor), the caller would leave it running. It gets SIGTERM when the caller exits, and SIGKILL
    ``grace_s`` later if it ignores that."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "fork_server_targets.py").write_text(_TARGETS)
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, str(tmp_path), target, str(grace_s)],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(caller.stdout.readline())
        time.sleep(1.0)
        assert _running(child)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(30)
    deadline = time.monotonic() + within_s
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _running(child):
        os.kill(child, signal.SIGKILL)  # not left behind by a failing run
        pytest.fail(f"the fork-server process {child} still runs {within_s} s after its caller was killed")
