"""Fixtures for the aligned megatron-core tests: their own tiny checkpoints and engine.

They do not share the session engine because the weight-sync test changes the engine's
weights. Everything here is package-scoped: consistent numerics is switched on while these tests run and
the engine (one start, ~30 s on CPU) is shut down when they are done.
"""

from __future__ import annotations

import pytest

from support.vllm_session import MAX_MODEL_LEN, prompts_for, rollout

ENGINE_KWARGS = dict(max_model_len=MAX_MODEL_LEN, seed=0)


@pytest.fixture(scope="package", autouse=True)
def mg_consistent_mode():
    from zero_mismatch_plugin.aligned.numerics import consistent_numerics

    with consistent_numerics():
        yield


@pytest.fixture(scope="package")
def mg_checkpoints(tmp_path_factory, mg_consistent_mode):
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("megatron_tiny_models")
    return {
        "llama": build_tiny_model(root / "llama", family="llama", seed=1),
        # Four layers: two model chunks of one layer on each of two pipeline stages (virtual stages).
        "qwen3": build_tiny_model(root / "qwen3", family="qwen3", seed=2, num_hidden_layers=4),
        # Mixture-of-Experts at tensor parallelism (test_megatron_tensor_parallel.py); Qwen3-MoE's
        # four layers for virtual stages too.
        "qwen3_moe": build_tiny_model(root / "qwen3_moe", family="qwen3_moe", seed=3, num_hidden_layers=4),
        "glm4_moe": build_tiny_model(root / "glm4_moe", family="glm4_moe", seed=4),
    }


@pytest.fixture(scope="package")
def mg_runtime(mg_checkpoints):
    """The engine's config and vLLM layers for the Llama checkpoint (trainer side)."""
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    return VllmRuntime(mg_checkpoints["llama"], **ENGINE_KWARGS)


@pytest.fixture(scope="package")
def mg_engine(mg_checkpoints):
    from vllm import LLM

    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    llm = LLM(**engine_args_for(mg_checkpoints["llama"], **ENGINE_KWARGS))
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="package")
def mg_rollout(mg_engine, mg_checkpoints):
    """rollout(seed, n=...) on the Llama engine with the standard prompts."""
    prompts = prompts_for(mg_checkpoints["llama"], corpus_seed=11)

    def run(seed=0, **kwargs):
        return rollout(mg_engine, prompts, seed=seed, **kwargs)

    return run
