"""vLLM's CPU gated delta-net (Qwen3-Next, Qwen3.5), made to agree with itself in consistent mode.

vLLM's ``_cpu_gdn_attention_nonspec`` prefills with the chunked kernel and decodes with the
recurrent one, and convolves prefills and decodes with different kernels (which also differ by
host: AVX-512-bf16 or not); a token's logprob depended on whether it was prefilled or decoded (a
tiny Qwen3-Next, bf16: 4% of the sampled tokens equal to their re-prefill, up to 0.57 nats apart).
In consistent mode on CPU every token goes through ``aligned.linear_attention.consistent_gdn_attention``:
the fixed-order causal convolution and vLLM's recurrent kernel one position at a time, as the
aligned trainer computes them. Speculative decoding's path (a wider conv buffer) is refused there.
Why: docs/patches.md (``vllm/0010``).
"""

from __future__ import annotations

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

GDN_ATTENTION = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"


def _one_arithmetic(original):
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        from zero_mismatch_plugin.aligned.linear_attention import consistent_gdn_attention

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
