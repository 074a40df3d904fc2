"""ZMRL_CPU_ENGINE_ONE_PROCESS: a CPU engine of world size 1 keeps the uni executor, only with one OMP thread."""

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
    from zero_mismatch_plugin.integrations.vllm.cpu_engine_process import (FORK_SERVER,
                                                                            _engine_cores_from_a_fork_server)

    monkeypatch.setenv("ZMRL_CPU_ENGINE_ONE_PROCESS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name, value in switches.items():
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
    held = runtime_patches.is_applied(FORK_SERVER) or runtime_patches.is_pending(FORK_SERVER)
    runtime_patches.remove(FORK_SERVER)
    try:
        plugin.register()
        applied = runtime_patches.is_applied(FORK_SERVER) or runtime_patches.is_pending(FORK_SERVER)
        assert applied == (method == "forkserver")
    finally:
        (runtime_patches.apply if held else runtime_patches.remove)(FORK_SERVER)
    get_mp_context = _engine_cores_from_a_fork_server(lambda: multiprocessing.get_context("spawn"))
    assert get_mp_context().get_start_method() == "forkserver"
    kept = _engine_cores_from_a_fork_server(lambda: multiprocessing.get_context("fork"))
    assert kept().get_start_method() == "fork"
