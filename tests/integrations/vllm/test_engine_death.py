"""An engine process that dies while ``LLM.generate`` waits: vLLM's EngineDeadError with the exit
code, within seconds, instead of a caller blocked for ever (the ``sync-client-engine-death`` patch)."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from zero_mismatch_plugin.integrations.vllm.engine_death import ENGINE_DEATH_POLL_S, _raise_when_the_engine_dies


def _client():
    """What the patched ``get_output`` reads of vLLM's SyncMPClient."""
    process = SimpleNamespace(exitcode=None)
    resources = SimpleNamespace(engine_dead=False, engine_manager=SimpleNamespace(processes=[process]))
    return SimpleNamespace(outputs_queue=queue.Queue(), resources=resources), process


def _get_output(client):  # vLLM's own get_output, reduced to what the wrapper hands over to
    return client.outputs_queue.get()


def test_a_waiting_caller_gets_the_outputs_as_before():
    client, _ = _client()
    get_output = _raise_when_the_engine_dies(_get_output)
    threading.Timer(0.2, client.outputs_queue.put, args=("outputs",)).start()
    assert get_output(client) == "outputs"
    client.outputs_queue.put("ready")  # already there: no wait
    assert get_output(client) == "ready"


def test_a_caller_waiting_when_the_engine_dies_gets_an_error_with_its_exit_code():
    from vllm.v1.engine.exceptions import EngineDeadError

    client, process = _client()
    get_output = _raise_when_the_engine_dies(_get_output)

    def die():  # what the client's monitor does: the exit seen, the dead mark set, nothing queued
        process.exitcode = -9
        client.resources.engine_dead = True

    threading.Timer(0.2, die).start()
    began = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"exit codes \[-9\]"):
        get_output(client)
    assert time.monotonic() - began < 0.2 + 2 * ENGINE_DEATH_POLL_S


def test_an_engine_killed_during_generate_raises_instead_of_hanging(engine_pool, checkpoints, consistent_mode):
    """A real engine (its own, not a shared one) killed mid-rollout: the rollout raises within
    seconds. Without the patch the caller of LLM.generate waits for ever."""
    from vllm import SamplingParams
    from vllm.v1.engine.exceptions import EngineDeadError

    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin

    vllm_plugin.register()  # vLLM loads its plugins once per process, maybe before the mode was set
    assert runtime_patches.is_applied(vllm_plugin.ENGINE_DEATH) or runtime_patches.is_pending(vllm_plugin.ENGINE_DEATH)
    llm = engine_pool.get(checkpoints["llama"], scope="engine_death")
    assert runtime_patches.is_applied(vllm_plugin.ENGINE_DEATH)  # else the kill below would hang this test
    try:
        (process,) = llm.llm_engine.engine_core.resources.engine_manager.processes
        # 128 x 200 tokens, so that the kill lands mid-rollout (64 x 200 outlasted a 1 s timer on a
        # 2-core host; a rollout finished before the kill fails the test, it cannot pass by it).
        threading.Timer(0.5, os.kill, args=(process.pid, signal.SIGKILL)).start()
        began = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"exit codes \[-9\]"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 128,
                         SamplingParams(max_tokens=200, ignore_eos=True, seed=0), use_tqdm=False)
        assert time.monotonic() - began < 30
    finally:
        engine_pool.discard(llm)
