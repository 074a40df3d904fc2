"""The suite's engine pool (``support/engine_pool.py``), with a stand-in for ``vllm.LLM``."""

import pytest

from support import engine_pool


class FakeLLM:
    """Writes a variable of its own the first time one is built in the process, as vLLM's CPU platform does."""

    def __init__(self, **args):
        self.args = args
        import os

        os.environ.setdefault("VLLM_FAKE_WRITTEN_AT_START", "spawn")


@pytest.fixture
def pool(monkeypatch):
    import vllm

    from zero_mismatch_plugin.aligned import runtime

    monkeypatch.delenv("VLLM_FAKE_WRITTEN_AT_START", raising=False)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    shut = []
    monkeypatch.setattr(runtime, "shutdown_engine", shut.append)
    made = engine_pool.EnginePool(capacity=2)
    made.shut = shut
    yield made
    monkeypatch.delenv("VLLM_FAKE_WRITTEN_AT_START", raising=False)


def test_the_same_request_after_a_start_that_wrote_variables_reuses_the_engine(pool, tmp_path):
    first = pool.get(tmp_path, max_model_len=64)
    assert pool.get(tmp_path, max_model_len=64) is first and pool.reused == 1 and len(pool.started) == 1
    pool.drop(tmp_path, max_model_len=64)  # found under the key it is reached by now
    assert pool.shut == [first]
    assert pool.get(tmp_path, max_model_len=64) is not first and len(pool.started) == 2


def test_another_setting_or_scope_starts_another_engine_and_the_oldest_goes_first(pool, tmp_path, monkeypatch):
    first = pool.get(tmp_path, max_model_len=64)
    other = pool.get(tmp_path, max_model_len=128)
    assert other is not first and pool.shut == []
    scoped = pool.get(tmp_path, scope="lora", max_model_len=64)
    assert scoped is not first and pool.shut == [first]
    monkeypatch.setenv("ZMRL_NUMERICS", "fast")  # a plugin switch the engine reads at start
    assert pool.get(tmp_path, max_model_len=128) is not other
