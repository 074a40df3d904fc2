"""The vLLM plugin applies the engine side of the consistent mode, and nothing when unset."""

import os

import pytest

from zero_mismatch_plugin.aligned import numerics
from zero_mismatch_plugin.aligned.vllm_compat import platform_kind
from zero_mismatch_plugin.aligned.weight_sync import WORKER_EXTENSION


def _config(checkpoint, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(checkpoint), dtype="float32", max_model_len=256, **kwargs).create_engine_config()


def test_consistent_mode_engine_settings(checkpoints):
    from zero_mismatch_plugin import vllm_plugin

    vllm_plugin.register()
    cfg = _config(checkpoints["llama"], enable_prefix_caching=True, enforce_eager=False)
    assert cfg.model_config.logprobs_mode == "processed_logprobs"
    assert cfg.model_config.enforce_eager
    assert not cfg.cache_config.enable_prefix_caching
    assert cfg.model_config.hf_config.head_dtype == "float32"
    assert cfg.parallel_config.worker_extension_cls == WORKER_EXTENSION
    assert os.environ[numerics.CPU_SPLIT_KV_ENV] == "0"


def test_vllm_changes_are_named_and_removable_with_the_environment(checkpoints, monkeypatch):
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.engine.arg_utils import EngineArgs

    from zero_mismatch_plugin import runtime_patches, vllm_plugin

    vllm_plugin.remove()  # start from nothing the plugin changed in this process
    original_config, original_gemm = EngineArgs.create_engine_config, layer_utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setenv(numerics.CPU_SPLIT_KV_ENV, "7")  # a value of the user's own
    environment = dict(os.environ)
    try:
        vllm_plugin.register()  # consistent mode here
        applied = vllm_plugin.applied()
        on_cpu = sorted(patch.name for patch in vllm_plugin.PATCHES)  # engine settings, GEMM, MLA
        assert applied == (on_cpu if platform_kind() == "cpu" else ["engine-args"]) and "cpu-gemm" in on_cpu
        assert os.environ[numerics.CPU_SPLIT_KV_ENV if platform_kind() == "cpu" else numerics.BATCH_INVARIANT_ENV] != \
            environment.get(numerics.CPU_SPLIT_KV_ENV if platform_kind() == "cpu" else numerics.BATCH_INVARIANT_ENV)
        assert EngineArgs.create_engine_config.__wrapped__ is original_config
        assert vllm_plugin.remove() == applied and vllm_plugin.applied() == []
        assert EngineArgs.create_engine_config is original_config
        assert layer_utils.dispatch_cpu_unquantized_gemm is original_gemm
        assert not set(applied) & set(runtime_patches.applied() + runtime_patches.pending())
        assert dict(os.environ) == environment
        assert _config(checkpoints["llama"], enable_prefix_caching=True).cache_config.enable_prefix_caching
    finally:
        monkeypatch.undo()
        vllm_plugin.register()  # the rest of the session runs with the plugin applied
    assert not _config(checkpoints["llama"], enable_prefix_caching=True).cache_config.enable_prefix_caching


def test_other_vllm_versions_are_refused_by_the_plugin(monkeypatch):
    import vllm

    from zero_mismatch_plugin import runtime_patches, vllm_plugin

    vllm_plugin.remove()
    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    try:
        with pytest.raises(runtime_patches.UnsupportedVersion, match="supports vllm 0.31.0; found vllm 0.30.0"):
            vllm_plugin.register()
        assert vllm_plugin.applied() == []
    finally:
        monkeypatch.undo()
        vllm_plugin.register()


def test_unset_mode_leaves_vllm_alone(checkpoints, monkeypatch):
    monkeypatch.delenv(numerics.MODE_ENV)
    cfg = _config(checkpoints["llama"], enable_prefix_caching=True)
    assert cfg.model_config.logprobs_mode == "raw_logprobs"
    assert cfg.cache_config.enable_prefix_caching
    assert cfg.parallel_config.worker_extension_cls == ""


def test_switch_sets_both_sides_for_each_platform(monkeypatch):
    for key in (numerics.MODE_ENV, numerics.CPU_SPLIT_KV_ENV, numerics.BATCH_INVARIANT_ENV):
        monkeypatch.delenv(key, raising=False)
    assert numerics.set_mode("consistent", platform="cuda") == {
        numerics.MODE_ENV: "consistent",
        numerics.BATCH_INVARIANT_ENV: "1",
    }
    assert os.environ[numerics.BATCH_INVARIANT_ENV] == "1"
    numerics.set_mode("fast", platform="cuda")
    assert numerics.BATCH_INVARIANT_ENV not in os.environ
    assert numerics.set_mode("consistent", platform="cpu")[numerics.CPU_SPLIT_KV_ENV] == "0"
    with pytest.raises(ValueError):
        numerics.set_mode("fastest", platform="cpu")


def test_live_engine_runs_with_consistent_settings(engines):
    llm = engines.get("llama")
    cfg = llm.llm_engine.vllm_config
    assert cfg.model_config.logprobs_mode == "processed_logprobs"
    assert cfg.model_config.enforce_eager
    assert not cfg.cache_config.enable_prefix_caching


def test_unsupported_vllm_version_fails_clearly(monkeypatch):
    import vllm

    from zero_mismatch_plugin.aligned.vllm_compat import UnsupportedVllmError, require_vllm

    monkeypatch.setattr(vllm, "__version__", "0.20.1")
    monkeypatch.delenv("ZMRL_ALLOW_UNSUPPORTED_VLLM", raising=False)
    with pytest.raises(UnsupportedVllmError, match="0.20.1 is not supported"):
        require_vllm()


def test_batch_invariant_module_found_under_a_known_path():
    from zero_mismatch_plugin.aligned.vllm_compat import BATCH_INVARIANT_MODULES, batch_invariant_module

    module = batch_invariant_module()
    assert module.__name__ in BATCH_INVARIANT_MODULES
    assert hasattr(module, "init_batch_invariance")
