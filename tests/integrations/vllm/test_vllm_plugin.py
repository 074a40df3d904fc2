"""The vLLM plugin applies the engine side of the consistent mode, and nothing when unset."""

import os

import pytest

from zero_mismatch_plugin.aligned import numerics
from zero_mismatch_plugin.aligned.vllm_compat import platform_kind
from zero_mismatch_plugin.aligned.runtime import WORKER_EXTENSION

pytestmark = pytest.mark.usefixtures("consistent_mode")


def _config(checkpoint, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(checkpoint), dtype="float32", max_model_len=256, **kwargs).create_engine_config()


def test_consistent_mode_engine_settings(checkpoints):
    from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    cfg = _config(checkpoints["llama"], enable_prefix_caching=True, enforce_eager=False)
    assert cfg.model_config.logprobs_mode == "processed_logprobs"
    assert cfg.model_config.enforce_eager
    # Proven for the dense decoders (tests/faces/aligned_model/test_aligned_prefix_caching.py): kept on.
    assert cfg.cache_config.enable_prefix_caching
    assert cfg.model_config.hf_config.head_dtype == "float32"
    assert cfg.parallel_config.worker_extension_cls == WORKER_EXTENSION
    assert os.environ[numerics.CPU_SPLIT_KV_ENV] == "0"


@pytest.mark.skipif(platform_kind() != "cpu", reason="vLLM's CPU platform chooses the MLA backend")
def test_mla_engine_on_a_host_with_amx_runs_the_backend_the_trainer_follows(checkpoints, monkeypatch):
    """A host with AMX tiles (planted here, so every host runs this) makes vLLM pick AMX_MLA with
    128-token blocks; in consistent mode the engine is pinned to CPU_MLA, which the trainer follows."""
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    vllm_plugin.register()
    pinned = _config(checkpoints["deepseek_v2"])
    assert pinned.attention_config.backend == AttentionBackendEnum.CPU_MLA
    assert pinned.cache_config.block_size == 16
    assert _config(checkpoints["llama"]).attention_config.backend is None  # only MLA models are pinned
    monkeypatch.delenv(numerics.MODE_ENV)
    stock = _config(checkpoints["deepseek_v2"])  # the plugin's negative control: what vLLM picks itself
    assert stock.attention_config.backend is None and stock.cache_config.block_size == 128


def test_vllm_changes_are_named_and_removable_with_the_environment(checkpoints, monkeypatch):
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.engine.arg_utils import EngineArgs

    from zero_mismatch_plugin.integrations import patches as runtime_patches

    from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin

    vllm_plugin.remove()  # start from nothing the plugin changed in this process
    original_config, original_gemm = EngineArgs.create_engine_config, layer_utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setenv(numerics.CPU_SPLIT_KV_ENV, "7")  # a value of the user's own
    environment = dict(os.environ)
    try:
        vllm_plugin.register()  # consistent mode here
        applied = vllm_plugin.applied()
        on_cpu = sorted(patch.name for patch in vllm_plugin.PATCHES)  # engine settings, GEMM, MLA
        assert applied == (on_cpu if platform_kind() == "cpu" else ["engine-args", "sync-client-engine-death"])
        assert "cpu-gemm" in on_cpu
        assert os.environ[numerics.CPU_SPLIT_KV_ENV if platform_kind() == "cpu" else numerics.BATCH_INVARIANT_ENV] != \
            environment.get(numerics.CPU_SPLIT_KV_ENV if platform_kind() == "cpu" else numerics.BATCH_INVARIANT_ENV)
        assert EngineArgs.create_engine_config.__wrapped__ is original_config
        assert vllm_plugin.remove() == applied and vllm_plugin.applied() == []
        assert EngineArgs.create_engine_config is original_config
        assert layer_utils.dispatch_cpu_unquantized_gemm is original_gemm
        assert not set(applied) & set(runtime_patches.applied() + runtime_patches.pending())
        assert dict(os.environ) == environment
        assert not _config(checkpoints["llama"], enforce_eager=False).model_config.enforce_eager
    finally:
        monkeypatch.undo()
        vllm_plugin.register()  # the rest of the session runs with the plugin applied
    assert _config(checkpoints["llama"], enforce_eager=False).model_config.enforce_eager


def test_a_trainer_built_after_a_stock_engine_has_the_engine_side_of_its_environment(checkpoints, monkeypatch):
    """vLLM runs its plugins once per process: after a stock engine was created here, building a
    trainer under the consistent environment still brings what every new engine process runs (on a
    host where torch's sigmoid tail rounds by call size, the GLM-4.5 router differed without it)."""
    import vllm.plugins

    from zero_mismatch_plugin.aligned import runtime
    from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin

    vllm_plugin.remove()  # as after a stock engine: nothing of the plugin in this process ...
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", True)  # ... and vLLM will not load it again
    try:
        assert _config(checkpoints["llama"]) is not None and vllm_plugin.applied() == []  # the fault, planted
        runtime.VllmRuntime(checkpoints["llama"], max_model_len=256)
        assert vllm_plugin.applied() == sorted(
            patch.name for patch in (vllm_plugin.PATCHES if platform_kind() == "cpu"
                                     else [vllm_plugin.ENGINE_ARGS, vllm_plugin.ENGINE_DEATH,
                                           vllm_plugin.LORA_MAPPER_NAME]))
    finally:
        monkeypatch.undo()
        vllm_plugin.register()


def test_other_vllm_versions_are_refused_by_the_plugin(monkeypatch):
    import vllm

    from zero_mismatch_plugin.integrations import patches as runtime_patches

    from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin

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


def test_switch_sets_both_sides_and_fast_takes_it_back(monkeypatch):
    for key in (numerics.MODE_ENV, numerics.CPU_SPLIT_KV_ENV, numerics.BATCH_INVARIANT_ENV):
        monkeypatch.delenv(key, raising=False)
    assert numerics.engine_env("consistent", "cuda") == {
        numerics.MODE_ENV: "consistent",
        numerics.BATCH_INVARIANT_ENV: "1",
    }
    environment = dict(os.environ)
    assert numerics.set_mode("consistent", platform="cpu") == {
        numerics.MODE_ENV: "consistent",
        numerics.CPU_SPLIT_KV_ENV: "0",
    }
    assert os.environ[numerics.CPU_SPLIT_KV_ENV] == "0" and os.environ[numerics.MODE_ENV] == "consistent"
    numerics.set_mode("fast", platform="cpu")
    assert dict(os.environ) == {**environment, numerics.MODE_ENV: "fast"}
    with pytest.raises(ValueError):
        numerics.set_mode("fastest", platform="cpu")
    assert dict(os.environ) == {**environment, numerics.MODE_ENV: "fast"}
    with numerics.consistent_numerics(platform="cpu") as switch:
        assert os.environ[numerics.MODE_ENV] == "consistent" and os.environ[numerics.CPU_SPLIT_KV_ENV] == "0"
        assert switch.saved_env == {numerics.MODE_ENV: "fast", numerics.CPU_SPLIT_KV_ENV: None}
    assert dict(os.environ) == {**environment, numerics.MODE_ENV: "fast"}


# vLLM's GPU switch (init_batch_invariance) run on this CPU: it installs its aten overrides under
# the CPU dispatch key and writes its NCCL / cuBLAS variables, so switching it off is checked for
# real. In a child process: a failure must not leave the overrides in the test session.
GPU_SWITCH_SCRIPT = """
import os, sys, torch
from zero_mismatch_plugin.integrations.vllm import plugin as vllm_plugin
from zero_mismatch_plugin.aligned import numerics, runtime
checkpoint = sys.argv[1]
x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 8
reference, bmm = torch.softmax(x, -1), torch.bmm
# vLLM's imports and its plugin loader write variables of their own: done before the snapshot.
numerics.batch_invariance_on()
runtime.VllmRuntime(checkpoint, max_model_len=256)
vllm_plugin.remove()
flags = numerics._torch_backend_flags()
environment = dict(os.environ)
runtime.platform_kind = lambda: "cuda"
try:
    runtime.VllmRuntime(checkpoint, max_model_len=256)
    raise SystemExit("built a consistent GPU trainer with the switch off")
except RuntimeError as error:
    assert "enable_consistent_numerics()" in str(error), error
assert dict(os.environ) == environment
with numerics.consistent_numerics(platform="cuda") as switch:
    assert numerics.batch_invariance_on() and torch.bmm is not bmm
    assert os.environ[numerics.BATCH_INVARIANT_ENV] == "1" and os.environ["NCCL_PROTO"] == "Simple"
    print("softmax under vLLM's overrides bit-equal to torch's:", torch.equal(torch.softmax(x, -1), reference))
    assert numerics.enable_consistent_numerics(platform="cuda").saved_env == {}  # nested: owns nothing
    runtime.VllmRuntime(checkpoint, max_model_len=256)  # switched on: built
    vllm_plugin.remove()  # what vLLM's plugin loader applied while the config was built
print("variables the switch set and restored:", sorted(switch.saved_env))
assert not numerics.batch_invariance_on() and torch.bmm is bmm
assert numerics._torch_backend_flags() == flags
assert torch.equal(torch.softmax(x, -1), reference)
assert dict(os.environ) == environment
print("SWITCH OK")
"""


def test_gpu_switch_is_explicit_and_undone_exactly(checkpoints):
    from support import preloaded_python

    # A Python that has not imported vLLM (support/preloaded_python.py).
    result = preloaded_python.shared().run(GPU_SWITCH_SCRIPT, str(checkpoints["llama"]), timeout=600)
    print(result.stdout)
    assert result.returncode == 0 and "SWITCH OK" in result.stdout, result.stdout + result.stderr[-4000:]


def test_building_a_trainer_leaves_the_environment_alone(checkpoints, monkeypatch):
    from zero_mismatch_plugin.aligned import runtime

    runtime.VllmRuntime(checkpoints["llama"], max_model_len=256)  # vLLM's imports write variables
    environment = dict(os.environ)
    runtime.VllmRuntime(checkpoints["llama"], max_model_len=256)  # consistent mode, this platform
    assert dict(os.environ) == environment
    # On a GPU platform with the switch off: refused, and nothing written (the former constructor
    # set VLLM_BATCH_INVARIANT and vLLM's process-wide overrides here).
    monkeypatch.setattr(runtime, "platform_kind", lambda: "cuda")
    with pytest.raises(RuntimeError, match=r"enable_consistent_numerics\(\)"):
        runtime.VllmRuntime(checkpoints["llama"], max_model_len=256)
    monkeypatch.setenv(numerics.MODE_ENV, "fast")
    environment = dict(os.environ)
    runtime.VllmRuntime(checkpoints["llama"], max_model_len=256)
    assert dict(os.environ) == environment
    assert not numerics.batch_invariance_on()


def test_live_engine_runs_with_consistent_settings(engines):
    llm = engines.get("llama")
    cfg = llm.llm_engine.vllm_config
    assert cfg.model_config.logprobs_mode == "processed_logprobs"
    assert cfg.model_config.enforce_eager
    assert cfg.cache_config.enable_prefix_caching  # the dense-decoder default in consistent mode


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


def test_cpu_gemm_patch_leaves_an_fp32_conv_weight_plain_and_hands_bf16_ones_to_vllm():
    """vLLM's dispatch VNNI-packs every 3-D (conv) weight on AVX-512-bf16 hosts with a packing kernel
    that takes bf16 only; KDA keeps its conv weight in fp32. A planted dispatch that fails as that
    kernel does on fp32 (whatever this host has): the patched dispatch never hands it an fp32 conv
    weight and leaves the weight as it was, and still hands it a bf16 one."""
    import torch

    from zero_mismatch_plugin.integrations.vllm.plugin import _pad_small_row_counts

    handed = []

    def planted_dispatch(layer, remove_weight):
        if layer.weight.dtype != torch.bfloat16:
            raise NotImplementedError('"causal_conv1d_fwd_kernel_impl" not implemented for \'Float\'')
        handed.append(layer.weight.dtype)

    dispatch = _pad_small_row_counts(planted_dispatch)
    fp32 = torch.nn.Module()
    fp32.weight = torch.nn.Parameter(torch.randn(12, 1, 4))
    before = fp32.weight.detach().clone()
    dispatch(fp32, remove_weight=True)
    assert torch.equal(fp32.weight, before) and not hasattr(fp32, "cpu_linear") and handed == []
    bf16 = torch.nn.Module()
    bf16.weight = torch.nn.Parameter(torch.randn(12, 1, 4).bfloat16())
    dispatch(bf16, remove_weight=True)
    assert handed == [torch.bfloat16]
