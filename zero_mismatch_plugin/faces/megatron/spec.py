"""The aligned megatron-core spec: dense and MoE layers built from :mod:`.modules` and :mod:`.moe`.

Stock megatron-core builds the rotary application, the final norm and the output layer outside
the layer spec: :func:`apply_post_construction_swaps` replaces them on the built model; with the
megatron-lm spec-hook patch :func:`aligned_model_spec` reaches them (docs/megatron.md).
"""

from __future__ import annotations

import copy
import functools

from zero_mismatch_plugin.aligned.runtime import VllmRuntime
from zero_mismatch_plugin.faces.megatron.convert import vllm_window
from zero_mismatch_plugin.faces.megatron.modules import (
    AlignedCoreAttention,
    AlignedLinearModule,
    AlignedOutputLayer,
    AlignedOutputLayerModule,
    AlignedQKVLinearModule,
    AlignedRMSNormModule,
    AlignedRotaryApplication,
    AlignedRowParallelLinearModule,
    AlignedTokenLogprob,
    aligned_mlp_class,
)
from zero_mismatch_plugin.faces.megatron.moe import AlignedRouter, aligned_moe_layer_class
from zero_mismatch_plugin.faces.megatron.pipeline import (
    boundary_problem,
    carry_addends_across_stages,
    send_addends_in_fp32,
    stage_layers,
)
from zero_mismatch_plugin.faces.megatron.residual import aligned_residual_add

# GPTModel.position_embedding_type after the swap: megatron skips its own rotary for any value
# other than rope/yarn/mrope; the rotation is done by AlignedCoreAttention.
ALIGNED_ROPE = "vllm_rope"


class UnsupportedMegatronFeature(NotImplementedError):
    """A megatron-core feature the aligned spec does not reproduce vLLM's numerics for."""


def unsupported_features(config) -> list[str]:
    """What in ``config`` (a TransformerConfig or Megatron-Bridge provider) is not supported."""

    def get(name, default=None):
        return getattr(config, name, default)

    problems = []
    if get("num_moe_experts"):
        problems += _moe_problems(get)
    if get("multi_latent_attention"):
        problems.append("multi-latent attention (MLA)")
    tp = get("tensor_model_parallel_size", 1) or 1
    if (tp != 1 and get("num_moe_experts") and (get("expert_model_parallel_size", 1) or 1) != 1
            and (get("expert_tensor_parallel_size", 1) or 1) != 1):
        problems.append("tensor with expert parallelism at expert_tensor_parallel_size > 1 (set it to 1: experts "
                        "whole on their rank, computed as the engine's tensor-parallel ranks split them)")
    boundary = boundary_problem(config)
    if boundary is not None:
        problems.append(boundary)
    if get("mtp_num_layers"):
        problems.append("multi-token prediction layers")
    if get("normalization", "RMSNorm") != "RMSNorm":
        problems.append(f"normalization={get('normalization')!r} (only RMSNorm)")
    if not get("gated_linear_unit", True):
        problems.append("non-gated MLP (only SwiGLU)")
    if get("add_bias_linear"):
        problems.append("biases on linear_proj / linear_fc1 / linear_fc2")
    if get("hidden_dropout") or get("attention_dropout"):
        problems.append("dropout (hidden_dropout / attention_dropout must be 0)")
    if get("fp8"):
        problems.append("fp8")
    if get("use_transformer_engine_full_layer_spec"):
        problems.append("the Transformer Engine full-layer spec")
    if get("qk_l2_norm"):
        problems.append("qk L2 norm")
    window = get("window_size")
    if window is not None and vllm_window(window) is None:
        problems.append(
            f"sliding-window attention (window_size={window!r}; the aligned spec takes causal "
            "windows (left, 0), of the architectures whose windows it covers)"
        )
    position = get("position_embedding_type", "rope")
    if position not in ("rope", ALIGNED_ROPE):
        problems.append(f"position_embedding_type={position!r} (only rope)")
    return problems


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _applies_aux_loss(get) -> bool:
    """Whether megatron's router adds a load-balancing loss: as ``TopKRouter.get_aux_loss_coeff``
    reads it, a coefficient counts only for the loss types ``moe_router_load_balancing_type``
    names (``"none"``, verl's RL setting, names none)."""
    kinds = _as_list(get("moe_router_load_balancing_type", "aux_loss"))
    coefficients = _as_list(get("moe_aux_loss_coeff", 0.0))
    if len(coefficients) == 1:
        coefficients = coefficients * len(kinds)
    return any(kind in ("aux_loss", "seq_aux_loss", "global_aux_loss") and coefficient
               for kind, coefficient in zip(kinds, coefficients))


# (setting -> refused?, what to say): the MoE settings the aligned MoE layer (vLLM's one-process
# router and experts, megatron's per-expert parameters) cannot run.
_MOE_REFUSALS = (
    (lambda get: (get("expert_tensor_parallel_size", 1) or 1) not in (1, get("tensor_model_parallel_size", 1) or 1),
     "expert tensor parallelism other than the tensor parallelism (expert_tensor_parallel_size: vLLM splits "
     "each expert over its tensor-parallel ranks)"),
    (lambda get: get("moe_grouped_gemm"),
     "moe_grouped_gemm (the aligned MoE layer keeps megatron's per-expert local experts: set it false)"),
    (lambda get: get("moe_latent_size"), "MoE latent projections (moe_latent_size)"),
    (lambda get: get("moe_shared_expert_overlap"), "moe_shared_expert_overlap"),
    (lambda get: get("moe_expert_capacity_factor") is not None,
     "expert capacity / token dropping (moe_expert_capacity_factor: vLLM drops no tokens)"),
    (lambda get: get("moe_router_enable_expert_bias") and get("moe_router_bias_update_rate", 0.0),
     "moe_router_bias_update_rate > 0 (the expert bias vLLM routes with is a weight: set 0)"),
    (lambda get: _applies_aux_loss(get) or get("moe_z_loss_coeff"),
     "MoE auxiliary losses (moe_aux_loss_coeff / moe_z_loss_coeff: set 0, or moe_router_load_balancing_type: none)"),
    (lambda get: get("moe_input_jitter_eps"), "router input jitter (moe_input_jitter_eps)"),
)


def _moe_problems(get) -> list[str]:
    return [message for refused, message in _MOE_REFUSALS if refused(get)]


def require_supported(config) -> None:
    problems = unsupported_features(config)
    if problems:
        raise UnsupportedMegatronFeature(
            "the aligned megatron spec does not support: " + "; ".join(problems)
        )


def aligned_layer_spec(config, runtime: VllmRuntime):
    """The aligned GPT layer ``ModuleSpec`` for ``config``, its ops built under ``runtime``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    require_supported(config)
    spec = copy.deepcopy(
        get_gpt_layer_local_spec(
            qk_layernorm=bool(getattr(config, "qk_layernorm", False)), normalization="RMSNorm"
        )
    )
    params = {"runtime": runtime}

    def norm(**extra):
        return ModuleSpec(module=AlignedRMSNormModule, params={**params, **extra})

    layer = spec.submodules
    layer.input_layernorm = norm()
    layer.pre_mlp_layernorm = norm(after_residual_add=True)
    # The norm after each residual add reads both addends, as vLLM's fused add + norm does.
    layer.self_attn_bda = aligned_residual_add
    layer.mlp_bda = aligned_residual_add
    attention = layer.self_attention.submodules
    attention.linear_qkv = ModuleSpec(module=AlignedQKVLinearModule, params=params)
    attention.linear_proj = ModuleSpec(module=AlignedRowParallelLinearModule, params=params)
    attention.core_attention = ModuleSpec(module=AlignedCoreAttention, params=params)
    if attention.q_layernorm is not IdentityOp:
        attention.q_layernorm = norm()
        attention.k_layernorm = norm()
    mlp = layer.mlp
    mlp.module = aligned_mlp_class()
    mlp.params = {**(mlp.params or {}), **params}
    mlp.submodules.linear_fc1 = ModuleSpec(module=AlignedLinearModule, params=params)
    mlp.submodules.linear_fc2 = ModuleSpec(module=AlignedRowParallelLinearModule, params=params)
    # The local spec's sharded_state_dict_keys_map stays: it stores the norms under Transformer
    # Engine's fused names, as the stock model's checkpoint does, so either resumes the other's.
    return spec


def aligned_moe_layer_spec(config, runtime: VllmRuntime):
    """The aligned layer spec of an MoE layer: megatron-core's local MoE spec (``MoELayer`` with
    ``SequentialMLP`` experts and ``SharedExpertMLP``) with the layer computed by
    :class:`.moe.AlignedMoELayer`, the router :class:`.moe.AlignedRouter` and the shared
    expert's linears vLLM's; attention and norms as :func:`aligned_layer_spec`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = aligned_layer_spec(config, runtime)
    local = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    mlp = copy.deepcopy(local.submodules.mlp)
    mlp.module = aligned_moe_layer_class()
    mlp.params = {**(mlp.params or {}), "runtime": runtime}
    mlp.submodules.router = functools.partial(AlignedRouter, runtime=runtime)
    shared = mlp.submodules.shared_experts.submodules
    shared.linear_fc1 = ModuleSpec(module=AlignedLinearModule, params={"runtime": runtime})
    shared.linear_fc2 = ModuleSpec(module=AlignedRowParallelLinearModule, params={"runtime": runtime})
    spec.submodules.mlp = mlp
    return spec


def moe_layer_pattern(config) -> list[bool]:
    """Which layers megatron builds as MoE layers (``moe_layer_freq``), as megatron reads it."""
    if not getattr(config, "num_moe_experts", None):
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(f) for f in freq]


def aligned_layer_specs(config, runtime: VllmRuntime) -> list:
    """One aligned layer spec per decoder layer: dense or MoE, as ``moe_layer_freq`` says."""
    dense = aligned_layer_spec(config, runtime)
    if not getattr(config, "num_moe_experts", None):
        return [dense] * config.num_layers
    moe = aligned_moe_layer_spec(config, runtime)
    return [moe if is_moe else dense for is_moe in moe_layer_pattern(config)]


def stage_layer_specs(config, runtime: VllmRuntime, vp_stage: int | None = None) -> list:
    """The layer specs of this pipeline stage's layers (all layers at pipeline parallelism 1; with
    virtual stages, model chunk ``vp_stage``'s), sliced as megatron's ``get_gpt_decoder_block_spec``
    slices its own."""
    layers = stage_layers(config, vp_stage=vp_stage)
    return aligned_layer_specs(config, runtime)[layers.start: layers.stop]


def aligned_block_spec(config, runtime: VllmRuntime, vp_stage: int | None = None):
    """The decoder spec for stock megatron-core: a ``TransformerBlockSubmodules`` of this stage's
    layer specs with vLLM's RMSNorm as the final norm (megatron's own final norm, built from a bare
    layer spec, refuses sequence parallelism)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(
        layer_specs=stage_layer_specs(config, runtime, vp_stage),
        layer_norm=ModuleSpec(module=AlignedRMSNormModule, params={"runtime": runtime, "after_residual_add": True}),
    )


def megatron_has_spec_hooks() -> bool:
    """Whether the installed megatron-core carries the spec hooks of the megatron-lm patch."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer.attention import SelfAttentionSubmodules

    return hasattr(gpt_model, "GPTModelSubmodules") and (
        "rotary_application" in getattr(SelfAttentionSubmodules, "__dataclass_fields__", {})
    )


def aligned_model_spec(config, runtime: VllmRuntime, temperature: float = 1.0, vp_stage=None):
    """The whole aligned model as one ``GPTModelSubmodules`` spec (patched megatron-core only).

    Layers: :func:`aligned_layer_spec` with the rotation moved to the attention's
    ``rotary_application`` hook; final norm: vLLM's RMSNorm; ``output_layer``: vLLM's lm_head and
    logits processor; ``token_logprob``: vLLM's sampler logprob at ``temperature``.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not megatron_has_spec_hooks():
        raise UnsupportedMegatronFeature(
            "this megatron-core has no spec hooks for the rotary application, output layer and "
            "per-token logprob: apply patches/megatron-lm (zmrl patches apply --to <Megatron-LM "
            "checkout>) or use aligned_layer_spec + apply_post_construction_swaps"
        )
    from megatron.core.models.gpt.gpt_model import GPTModelSubmodules

    params = {"runtime": runtime}
    layers = []
    for layer in stage_layer_specs(config, runtime, vp_stage):
        layer = copy.copy(layer)
        layer.submodules = copy.copy(layer.submodules)
        layer.submodules.self_attention = copy.deepcopy(layer.submodules.self_attention)
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = ModuleSpec(
            module=AlignedCoreAttention, params={**params, "rotates_qk": False}
        )
        attention.rotary_application = ModuleSpec(module=AlignedRotaryApplication, params=params)
        layers.append(layer)
    return GPTModelSubmodules(
        layer_specs=layers,
        layer_norm=ModuleSpec(module=AlignedRMSNormModule, params={**params, "after_residual_add": True}),
        output_layer=ModuleSpec(module=AlignedOutputLayerModule, params=params),
        token_logprob=ModuleSpec(module=AlignedTokenLogprob, params={"temperature": temperature}),
    )


def aligned_gpt_spec(config, runtime: VllmRuntime, vp_stage=None):
    """``(spec, needs_swaps)``: the hooked model spec on a patched megatron-core, else the layer
    spec, after whose model :func:`apply_post_construction_swaps` must run. In bf16 at pipeline
    parallelism > 1 it sets ``config.pipeline_dtype`` to fp32 (:func:`.pipeline.send_addends_in_fp32`)."""
    send_addends_in_fp32(config)
    if megatron_has_spec_hooks():
        return aligned_model_spec(config, runtime, vp_stage=vp_stage), False
    return aligned_block_spec(config, runtime, vp_stage), True


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def apply_post_construction_swaps(model, runtime: VllmRuntime):
    """Swap what the layer spec does not reach on a constructed GPTModel; returns ``model``.

    * rotary: megatron's application is switched off, :class:`AlignedCoreAttention` rotates;
    * final norm: vLLM's RMSNorm (keeps the existing parameter);
    * output layer: vLLM's lm_head + ``LogitsProcessor`` (keeps the existing parameter);
    * in bf16 at pipeline parallelism > 1, the stage boundary carries the residual sum's addends
      (:func:`.pipeline.carry_addends_across_stages`; on a model built from the hooked spec too).
    """
    gpt = _unwrap(model)
    require_supported(gpt.config)
    carry_addends_across_stages(gpt)
    attentions = [m for m in gpt.modules() if isinstance(m, AlignedCoreAttention)]
    if not attentions:
        raise ValueError("model was not built from the aligned layer spec (no AlignedCoreAttention)")
    if not any(a.rotates_qk for a in attentions):
        # Built from aligned_model_spec: the spec hooks placed every module already.
        return model
    if getattr(gpt, "position_embedding_type", "rope") not in ("rope", ALIGNED_ROPE):
        raise UnsupportedMegatronFeature(
            f"position_embedding_type={gpt.position_embedding_type!r}"
        )
    gpt.position_embedding_type = ALIGNED_ROPE
    for attention in attentions:
        attention.applies_rotary = True

    decoder = gpt.decoder
    final = getattr(decoder, "final_layernorm", None)
    if final is not None and not isinstance(final, AlignedRMSNormModule):
        eps = getattr(final, "eps", gpt.config.layernorm_epsilon)
        swapped = AlignedRMSNormModule(
            gpt.config, final.weight.shape[0], eps=eps, runtime=runtime
        )
        swapped.weight = final.weight
        decoder.final_layernorm = swapped

    if getattr(gpt, "post_process", False) and not isinstance(gpt.output_layer, AlignedOutputLayer):
        old = gpt.output_layer
        vocab = runtime.hf_config.vocab_size
        weight = getattr(old, "weight", None)
        if gpt.share_embeddings_and_output_weights and gpt.pre_process:
            # GPTModel passes the embedding weight at each call; a last pipeline stage keeps its
            # own copy of the tied embedding (megatron's) as the output layer's weight.
            weight = None
        head = AlignedOutputLayer(runtime, weight, vocab, config=gpt.config)
        gpt.output_layer = head
    return model


def aligned_modules(model):
    """All aligned modules of ``model`` (for refreshing their engine-layout weights)."""
    gpt = _unwrap(model)
    kinds = (AlignedLinearModule, AlignedOutputLayer, AlignedRMSNormModule, AlignedRouter, aligned_moe_layer_class())
    return [m for m in gpt.modules() if isinstance(m, kinds)]


def refresh_aligned_weights(model) -> None:
    """Re-derive every engine-layout weight copy now.

    Needed after writes that bypass the tensors' version counters (``param.data.copy_``, as
    some optimizers and checkpoint loaders do); in-place updates are picked up automatically.
    """
    from zero_mismatch_plugin.faces.megatron.lora import MegatronLoRA, MegatronVocabLoRA

    for m in aligned_modules(model):
        if isinstance(m, AlignedRMSNormModule):
            m._kernel().engine_weight.refresh()
        else:
            m.refresh()
    for m in _unwrap(model).modules():  # the adapters' own ops (the experts' are their layer's)
        if isinstance(m, (MegatronLoRA, MegatronVocabLoRA)):
            m.refresh()
