"""vLLM's wide lm_head on CPU (``head_dtype`` fp32 under a bf16 model), made row-count invariant.

Consistent mode asks the engine for an fp32 head (``hf_overrides.head_dtype``). Under a bf16 model
vLLM's ``LogitsProcessor._apply_head`` then casts the hidden states and the head weight to fp32 and
calls ``F.linear``, whose CPU kernel rounds a row by the call's row count and thread count: a lone
decoding sequence read other logprobs than its prefill. In consistent mode on CPU the product is
``aligned.row_invariant.row_invariant_wide_head``; the trainer's head calls the same processor, so
both sides compute it. A head in the model's own dtype (fp32 models) keeps vLLM's dispatched GEMM.
Why: docs/patches.md (``vllm/0009``).
"""

from __future__ import annotations

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

LOGITS_PROCESSOR = "vllm.model_executor.layers.logits_processor"


def _row_invariant_wide_head(original):
    from zero_mismatch_plugin.aligned.row_invariant import row_invariant_wide_head

    def _apply_head(self, lm_head, hidden_states, embedding_bias):
        head_dtype = self.head_dtype
        if head_dtype is None or head_dtype == hidden_states.dtype or hidden_states.device.type != "cpu":
            return original(self, lm_head, hidden_states, embedding_bias)
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        if not isinstance(lm_head.quant_method, (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)):
            return original(self, lm_head, hidden_states, embedding_bias)  # vLLM's own refusal
        return row_invariant_wide_head(hidden_states, lm_head.weight, embedding_bias, head_dtype)

    return _apply_head


WIDE_HEAD = consistent_cpu_vllm_patch(
    f"{LOGITS_PROCESSOR}:LogitsProcessor._apply_head", _row_invariant_wide_head,
    name="cpu-wide-head-row-invariant",
    why="an fp32 head under a bf16 model is vLLM's cast + F.linear, whose CPU kernel rounds a row by the "
        "call's row count and thread count (a lone decoding sequence read other logprobs than its prefill): "
        "computed row-count-invariantly",
)

CONSISTENT_MODE_PATCHES = [WIDE_HEAD]
