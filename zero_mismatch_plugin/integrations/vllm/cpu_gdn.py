"""vLLM's CPU gated delta-net (Qwen3-Next, Qwen3.5), made to agree with itself in consistent mode.

vLLM's ``_cpu_gdn_attention_nonspec`` prefills with the chunked kernel and decodes with the
recurrent one, and convolves prefills and decodes with different kernels (which also differ by
host: AVX-512-bf16 or not); a token's logprob depended on whether it was prefilled or decoded (a
tiny Qwen3-Next, bf16: 4% of the sampled tokens equal to their re-prefill, up to 0.57 nats apart).
In consistent mode on CPU every token goes through :mod:`zero_mismatch_plugin.aligned.linear_attention`:
the fixed-order causal convolution and vLLM's recurrent kernel one position at a time, as the
aligned trainer computes them. Speculative decoding's path (a wider conv buffer) is refused there.
Why: docs/patches.md (``vllm/0010``).
"""

from __future__ import annotations

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

GDN_ATTENTION = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"


def conv_weight(conv1d):
    """The (channels, width) weight of vLLM's conv1d layer, also where vLLM's CPU dispatch
    VNNI-packed it in place (AVX-512-bf16 hosts) and kept the plain copy beside it."""
    plain = getattr(conv1d, "_cpu_unpacked_conv_weight", None)
    if plain is not None:
        return plain
    weight = conv1d.weight
    return weight.view(weight.size(0), weight.size(-1)) if weight.dim() == 3 else weight


def consistent_gdn_attention(layer, attn_metadata, mixed_qkv, b, a, core_attn_out) -> None:
    """The core of one gated delta-net layer for a mixed decode + prefill step (vLLM's metadata
    order: decodes first), each token computed as the aligned trainer computes it."""
    import torch

    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from zero_mismatch_plugin.aligned.linear_attention import fixed_order_causal_conv, recurrent_gated_delta_rule

    slots = attn_metadata.non_spec_state_indices_tensor
    starts = attn_metadata.non_spec_query_start_loc
    num_decodes, num_prefills = attn_metadata.num_decodes, attn_metadata.num_prefills
    num_seqs = num_decodes + num_prefills
    num_tokens = attn_metadata.num_decode_tokens + attn_metadata.num_prefill_tokens
    # The conv state as [slots, width - 1, channels] (time-major) over either cache layout.
    conv_states = layer.kv_cache[0]
    if is_conv_state_dim_first():
        conv_states = conv_states.transpose(-1, -2)
    ssm_states = layer.kv_cache[1]
    ssm_states = ssm_states.view(ssm_states.size(0), ssm_states.size(1), ssm_states.size(3), ssm_states.size(2))
    weight, bias = conv_weight(layer.conv1d), layer.conv1d.bias
    mixed_qkv = mixed_qkv[:num_tokens]
    conv_out = torch.empty_like(mixed_qkv)

    if num_decodes:
        decode_slots = slots[:num_decodes].long()
        out, previous = fixed_order_causal_conv(
            mixed_qkv[:num_decodes, None], weight, bias, conv_states[decode_slots], layer.activation)
        conv_out[:num_decodes] = out[:, 0]
        conv_states[decode_slots] = previous.to(conv_states.dtype)
    has_initial_state = attn_metadata.has_initial_state
    for i in range(num_decodes, num_seqs):
        slot, rows = int(slots[i]), slice(int(starts[i]), int(starts[i + 1]))
        fresh = not bool(has_initial_state[i])
        out, previous = fixed_order_causal_conv(
            mixed_qkv[rows], weight, bias, None if fresh else conv_states[slot], layer.activation)
        conv_out[rows] = out
        conv_states[slot] = previous.to(conv_states.dtype)
        if fresh:
            ssm_states[slot] = 0

    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    lengths = (starts[1 : num_seqs + 1] - starts[:num_seqs]).tolist()
    core_attn_out[:num_tokens] = recurrent_gated_delta_rule(
        query[0], key[0], value[0], a[:num_tokens], b[:num_tokens], layer.A_log, layer.dt_bias,
        ssm_states, slots[:num_seqs], lengths,
    )


def _one_arithmetic(original):
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        if attn_metadata_i.spec_sequence_masks is not None or attn_metadata_i.num_accepted_tokens is not None:
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)  # vLLM's own refusal
        consistent_gdn_attention(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)

    return _cpu_gdn_attention_nonspec


def _refuse_speculative(original):
    def _cpu_gdn_attention_spec_aware(*args, **kwargs):
        raise NotImplementedError(
            "ZMRL_NUMERICS=consistent: gated delta-net layers under speculative decoding are not covered "
            "(their draft-token path keeps a wider conv buffer and its own kernel); serve without "
            "speculative_config, or set ZMRL_NUMERICS=fast"
        )

    return _cpu_gdn_attention_spec_aware


GDN_ONE_ARITHMETIC = consistent_cpu_vllm_patch(
    f"{GDN_ATTENTION}:_cpu_gdn_attention_nonspec", _one_arithmetic,
    name="cpu-gdn-one-arithmetic",
    why="vLLM's CPU gated delta-net prefills with a chunked kernel and decodes with a recurrent one (and two "
        "conv kernels), which round differently: every token through the fixed-order conv and the recurrent kernel",
)

GDN_NO_SPECULATIVE = consistent_cpu_vllm_patch(
    f"{GDN_ATTENTION}:_cpu_gdn_attention_spec_aware", _refuse_speculative,
    name="cpu-gdn-refuse-speculative",
    why="the speculative-decoding path of the CPU gated delta-net is not made consistent: refused with the reason",
)

CONSISTENT_MODE_PATCHES = [GDN_ONE_ARITHMETIC, GDN_NO_SPECULATIVE]
