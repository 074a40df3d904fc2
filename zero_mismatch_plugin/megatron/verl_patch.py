"""Runtime patch of verl's Megatron engine: aligned mcore spec + vLLM's logprob arithmetic.

Enabled by ``ZMRL_MEGATRON_ALIGNED=1`` (see :func:`maybe_apply`) or by calling :func:`apply`;
undone by :func:`remove`, which puts back the exact original callables. Only for the verl
versions in :data:`SUPPORTED_VERL_VERSIONS` (the engine module's internals were checked there);
any other version is refused with :class:`UnsupportedVerlVersion`.

What changes in ``verl.workers.engine.megatron.transformer_impl``:

* ``MegatronEngine._build_tf_config``: after verl's own body, the Megatron-Bridge provider's
  ``transformer_layer_spec`` becomes the aligned spec (built from ``get_gpt_layer_local_spec``)
  and a pre-wrap hook applies the post-construction swaps (rotary, final norm, output layer).
  Both use a :class:`~..aligned.runtime.VllmRuntime` of the checkpoint the actor loads.
* ``MegatronEngineWithLMHead._lm_head_logits_processor``: verl divides the (bf16) logits by the
  temperature in place and takes ``-vocab_parallel_cross_entropy``; the patch divides fp32 logits
  by the fp32 temperature and takes ``log_softmax(dim=-1, dtype=float32)`` (vLLM's
  ``Sampler.apply_temperature`` + ``Sampler.compute_logprobs``), then gathers the labels.
* ``MegatronEngine.optimizer_step`` / ``load_checkpoint``: afterwards the engine-layout weight
  copies are re-derived (megatron writes updated weights through ``param.data``).

On a verl fork with ``patches/verl/0004-megatron-engine-hooks.patch`` nothing is replaced: the
same functions are registered in the engine module's ``ENGINE_HOOKS`` and
``LM_HEAD_LOGITS_PROCESSOR``, and :func:`remove` takes them out again. On a megatron-core with
the megatron-lm spec-hook patch the provider gets the whole-model spec and no pre-wrap swaps.
"""

from __future__ import annotations

import logging
import os
from functools import wraps

logger = logging.getLogger("zero_mismatch_plugin")

ENABLE_ENV = "ZMRL_MEGATRON_ALIGNED"
SUPPORTED_VERL_VERSIONS = ("0.9.1",)
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"

# (class name, attribute) -> original function, while methods are replaced (stock verl).
_originals: dict[tuple[str, str], object] = {}
# (hook list, function) pairs registered in a hooked verl's engine module, while applied.
_registered: list[tuple[list, object]] = []
_RUNTIME_ATTR = "_zmrl_vllm_runtime"


class UnsupportedVerlVersion(RuntimeError):
    pass


def verl_version() -> str:
    import verl

    return getattr(verl, "__version__", "unknown")


def check_verl_version() -> str:
    version = verl_version()
    if version not in SUPPORTED_VERL_VERSIONS:
        raise UnsupportedVerlVersion(
            f"the aligned Megatron patch supports verl {', '.join(SUPPORTED_VERL_VERSIONS)}; "
            f"found verl {version}"
        )
    return version


def _engine_module():
    import importlib

    return importlib.import_module(ENGINE_MODULE)


def enabled_by_env() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_applied() -> bool:
    return bool(_originals or _registered)


def engine_has_hooks(ti) -> bool:
    """Whether verl's Megatron engine module has the extension points of the verl patch 0004."""
    return hasattr(ti, "ENGINE_HOOKS") and hasattr(ti, "LM_HEAD_LOGITS_PROCESSOR")


# ----- vLLM's logprob arithmetic -----------------------------------------------------------


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
    """``_lm_head_logits_processor`` with vLLM's arithmetic (same outputs and keys as verl's)."""
    from ..aligned.sampling import gather_labels, vllm_logprobs, vllm_scaled_logits

    ti = _engine_module()
    assert logits.shape[:2] == label.shape[:2]
    if _tensor_parallel_size() != 1:
        raise NotImplementedError("aligned logprobs: vocabulary-parallel logits (TP > 1)")
    # verl's guard for padding rows, kept as is.
    temperature[temperature <= 0] = 1e-8
    scaled = vllm_scaled_logits(logits, temperature)
    ret = {}
    if calculate_sum_pi_squared:
        ret["sum_pi_squared"] = ti.vocab_parallel_sum_pi_squared(scaled)
    if calculate_entropy:
        # verl's entropy kernels may work in place on their input.
        entropy_input = scaled.clone()
        if self.engine_config.entropy_from_logits_with_chunking:
            ret["entropy"] = ti.vocab_parallel_entropy_with_chunking(
                entropy_input, chunk_size=self.engine_config.entropy_from_logits_chunk_size
            )
        else:
            ret["entropy"] = ti.vocab_parallel_entropy(entropy_input)
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
        from .spec import aligned_gpt_spec

        spec, _ = aligned_gpt_spec(config, self.runtime, vp_stage=vp_stage)
        return spec


class PostConstructionSwaps:
    """Megatron-Bridge pre-wrap hook: the swaps the spec does not reach, on every model chunk."""

    def __init__(self, runtime):
        self.runtime = runtime

    def __call__(self, model):
        from .spec import apply_post_construction_swaps

        chunks = model if isinstance(model, (list, tuple)) else [model]
        for chunk in chunks:
            apply_post_construction_swaps(chunk, self.runtime)
        return model


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def inject_aligned_spec(engine, runtime=None) -> None:
    """Point ``engine.provider`` at the aligned spec and register the post-construction swaps.

    ``engine`` is a verl ``MegatronEngine`` after verl's ``_build_tf_config``. The runtime is
    built from the checkpoint the actor loads, in the actor's parameter dtype: the rollout must
    serve the same checkpoint in the same dtype.
    """
    from ..aligned.runtime import VllmRuntime
    from .spec import UnsupportedMegatronFeature, require_supported

    if getattr(engine, "is_value_model", False):
        logger.info("zero-mismatch: value model left on the stock Megatron spec")
        return
    provider = getattr(engine, "provider", None)
    if provider is None:
        raise UnsupportedMegatronFeature(
            "the aligned Megatron spec needs verl's Megatron-Bridge path "
            "(megatron.use_mbridge=True, megatron.vanilla_mbridge=False)"
        )
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
    if getattr(engine, "peft_cls", None) is not None:
        raise UnsupportedMegatronFeature("LoRA / PEFT on the aligned Megatron spec")
    require_supported(provider)
    backend = getattr(provider, "attention_backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) == "local":
        # Megatron-Bridge then overwrites core_attention with megatron's DotProductAttention.
        raise UnsupportedMegatronFeature("attention_backend=local replaces the aligned core attention")
    if not hasattr(provider, "register_pre_wrap_hook"):
        raise UnsupportedMegatronFeature("this Megatron-Bridge provider has no register_pre_wrap_hook")
    if runtime is None:
        runtime = VllmRuntime(engine.model_config.local_path, dtype=_dtype_name(engine.param_dtype))
    from .spec import megatron_has_spec_hooks

    provider.transformer_layer_spec = AlignedSpecFactory(runtime)
    if not megatron_has_spec_hooks():
        provider.register_pre_wrap_hook(PostConstructionSwaps(runtime))
    setattr(engine, _RUNTIME_ATTR, runtime)


def refresh_engine_weights(engine) -> None:
    from .spec import refresh_aligned_weights

    if getattr(engine, _RUNTIME_ATTR, None) is None:
        return
    for chunk in getattr(engine, "module", None) or []:
        refresh_aligned_weights(chunk)


# ----- apply / remove ----------------------------------------------------------------------


def _patched_build_tf_config(original):
    @wraps(original)
    def _build_tf_config(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        inject_aligned_spec(self)
        return result

    return _build_tf_config


def _refresh_after(original):
    @wraps(original)
    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        refresh_engine_weights(self)
        return result

    return method


def _aligned_processor(original):
    @wraps(original)
    def _lm_head_logits_processor(self, *args, **kwargs):
        return aligned_lm_head_logits_processor(self, *args, **kwargs)

    return _lm_head_logits_processor


def _targets(ti):
    return [
        (ti.MegatronEngine, "_build_tf_config", _patched_build_tf_config),
        (ti.MegatronEngine, "optimizer_step", _refresh_after),
        (ti.MegatronEngine, "load_checkpoint", _refresh_after),
        (ti.MegatronEngineWithLMHead, "_lm_head_logits_processor", _aligned_processor),
    ]


def _hook_registrations(ti):
    return [
        (ti.ENGINE_HOOKS["_build_tf_config"], inject_aligned_spec),
        (ti.ENGINE_HOOKS["optimizer_step"], refresh_engine_weights),
        (ti.ENGINE_HOOKS["load_checkpoint"], refresh_engine_weights),
        (ti.LM_HEAD_LOGITS_PROCESSOR, aligned_lm_head_logits_processor),
    ]


def apply() -> bool:
    """Install the patch (idempotent). Returns True when it was installed by this call.

    A verl with the engine hooks gets the functions registered in them; stock verl gets the
    four methods wrapped / replaced.
    """
    if is_applied():
        return False
    version = check_verl_version()
    ti = _engine_module()
    if engine_has_hooks(ti):
        for hooks, function in _hook_registrations(ti):
            hooks.append(function)
            _registered.append((hooks, function))
        how = "registered in the engine hooks"
    else:
        for cls, name, make in _targets(ti):
            original = cls.__dict__[name]
            _originals[(cls.__name__, name)] = original
            setattr(cls, name, make(original))
        how = "engine methods patched"
    logger.warning(
        "zero-mismatch: verl %s Megatron engine (%s): aligned mcore spec (vLLM kernels) and "
        "vLLM logprob arithmetic are active", version, how
    )
    return True


def remove() -> bool:
    """Restore the original callables / take out the registered hooks. True when something was undone."""
    if not is_applied():
        return False
    while _registered:
        hooks, function = _registered.pop()
        hooks.remove(function)
    if _originals:
        ti = _engine_module()
        for cls, name, _ in _targets(ti):
            setattr(cls, name, _originals.pop((cls.__name__, name)))
    return True


def maybe_apply() -> bool:
    """Apply when ``ZMRL_MEGATRON_ALIGNED`` is set; for the plugin's verl entry point."""
    if not enabled_by_env():
        return False
    apply()
    return True
