"""Kimi Delta Attention (Kimi Linear's KDA layers) served on vLLM's CPU backend in consistent mode.

vLLM 0.31 has no CPU path for KDA: ``KimiGatedDeltaNetAttention._forward`` calls Triton kernels
(``chunk_kda_with_fused_gate``, ``fused_recurrent_kda_packed_decode``, ``gather_initial_states``)
that a CPU cannot run (and which, by the seed's account, round prefill and decode differently). In
consistent mode on CPU the layer's core goes through ``aligned.kimi_delta_attention.consistent_kda_attention``: the
fixed-order conv, the KDA recurrence one position at a time and the gated output norm, as the
aligned trainer computes them. Two more things stand in the way of serving Kimi Linear on a CPU,
each patched here with the reason:

- the model builds a fused GEMM + all-reduce (``VLLM_KIMI_K3_GEMM_AR``, on by default) from
  ``cutlass`` (CUDA only): never on CPU;
- vLLM's CPU linear dispatch VNNI-packs every 3-D (conv) weight on AVX-512-bf16 hosts, and its
  packing kernel takes bf16 only, while KDA keeps its conv weight in fp32 whatever the model
  dtype ("causal_conv1d_fwd_kernel_impl not implemented for 'Float'"): an fp32 conv weight is left
  plain (the consistent path reads it plain anyway); that is part of the ``cpu-gemm`` patch.

Speculative decoding's KDA path (``fused_recurrent_kda`` over draft tokens) is refused by name.
Why: docs/zero-mismatch.md ("Linear attention: Kimi Delta Attention").
"""

from __future__ import annotations

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

KDA_LAYER = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
KIMI_MODEL = "vllm.models.kimi_k3.nvidia.model"


def _one_arithmetic(original):
    def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
        from vllm.forward_context import get_forward_context

        from zero_mismatch_plugin.aligned.kimi_delta_attention import cpu_kda_forward

        cpu_kda_forward(self, get_forward_context().attn_metadata, mixed_qkv, g1, g2, beta, core_attn_out)

    return _forward


def _no_cuda_gemm_all_reduce(original):
    def maybe_init_gemm_rs_ar(vllm_config, use_sequence_parallel):
        return False  # cutlass' fused GEMM + all-reduce / reduce-scatter is CUDA only

    return maybe_init_gemm_rs_ar


KDA_ONE_ARITHMETIC = consistent_cpu_vllm_patch(
    f"{KDA_LAYER}:KimiGatedDeltaNetAttention._forward", _one_arithmetic,
    name="cpu-kda-one-arithmetic",
    why="vLLM's KDA runs only as Triton kernels (a chunked prefill and a recurrent decode, two arithmetics "
        "for the same tokens): on CPU every token goes through the fixed-order conv and one KDA recurrence",
)

KIMI_NO_CUDA_GEMM_ALL_REDUCE = consistent_cpu_vllm_patch(
    f"{KIMI_MODEL}:maybe_init_gemm_rs_ar", _no_cuda_gemm_all_reduce,
    name="cpu-kimi-no-cutlass-gemm-all-reduce",
    why="Kimi Linear builds cutlass' fused GEMM + all-reduce unless VLLM_KIMI_K3_GEMM_AR=0; cutlass is "
        "CUDA only, so a CPU engine could not start",
)

# vLLM's SupportsLoRA members, as a model class that inherits the protocol would have them: its
# LoRA check is a runtime protocol check of these attributes. Kimi Linear's experts are per-expert
# checkpoint weights (not 3-D), gated; its merged linears are those its inner model names.
_LORA_MEMBERS = {
    "supports_lora": lambda: True,
    "is_3d_moe_weight": lambda: False,
    "is_non_gated_moe": lambda: False,
    "embedding_modules": dict,
    "lora_skip_prefixes": list,
    "lora_manager": lambda: None,
    "packed_modules_mapping": lambda: dict(_kimi_linear_model().packed_modules_mapping),
    # The experts' checkpoint names (w1 / w3 / w2, as its load_weights reads them) for the LoRA
    # loader, which otherwise expects the MoE layer's default gate_proj / up_proj / down_proj.
    "get_expert_mapping": lambda: _checkpoint_expert_mapping,
}


def _checkpoint_expert_mapping(self):
    from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping

    return fused_moe_make_expert_params_mapping(self, ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2",
                                                ckpt_up_proj_name="w3", num_experts=self.config.num_experts)


def _kimi_linear_model():
    from vllm.models.kimi_k3.nvidia.model import KimiLinearModel

    return KimiLinearModel


def _lora_member(name):
    def build(original):
        return _LORA_MEMBERS[name]()

    return build


KIMI_LINEAR_LORA = [
    consistent_cpu_vllm_patch(
        f"{KIMI_MODEL}:KimiLinearForCausalLM.{name}", _lora_member(name),
        name=f"cpu-kimi-linear-lora-{name.replace('_', '-')}",
        why="KimiLinearForCausalLM declares no LoRA support, so vLLM refuses enable_lora for it; its layers are "
            "vLLM's LoRA-capable linears (and, on CPU, the plugin's LoRA-capable experts): it gets the "
            "SupportsLoRA members so that LoRA on every KDA projection, MLP and expert is served",
    )
    for name in _LORA_MEMBERS
]

CONSISTENT_MODE_PATCHES = [KDA_ONE_ARITHMETIC, KIMI_NO_CUDA_GEMM_ALL_REDUCE, *KIMI_LINEAR_LORA]
