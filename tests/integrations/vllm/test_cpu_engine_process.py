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
