"""vLLM 0.31.0's CPU MLA path (DeepSeek-V2/V3 attention), made correct and batch-invariant.

Runtime patches in consistent mode on CPU: the rotary kernel on 2-D rows (a correctness fix),
``kv_b_proj`` through vLLM's CPU GEMM dispatch, the absorbed decode's ``bmm`` in eight-row calls,
the decode kernel on one thread, and a one-token prompt always decoded. See docs/vllm-cpu-mla.md.
"""

from __future__ import annotations

import types

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

ROTARY_MODULE = "vllm.model_executor.layers.rotary_embedding.base"
LINEAR_MODULE = "vllm.model_executor.layers.linear"
MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"

# The kernels come from the op layer (zero_mismatch_plugin.aligned.row_invariant), which imports torch:
# imported when a patch is applied or called (vLLM, and so torch, already loaded), not with the plugin.


def rotary_on_rows(original):
    """``forward_cpu`` that gives vLLM's CPU rotary kernel the 2-D rows it reads."""
    from zero_mismatch_plugin.aligned.row_invariant import rotary_on_rows as rotate_rows_in_place

    def forward_cpu(self, positions, query, key=None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return original(self, positions, query, key)
        return rotate_rows_in_place(lambda query_rows, key_rows: original(self, positions, query_rows, key_rows),
                                    positions, query, key)

    return forward_cpu


def gemm_dispatch_for_skipped_layers(original):
    """``process_weights_after_loading`` that sends layers vLLM keeps off its CPU GEMM dispatch
    (MLA's ``kv_b_proj``) through it too, keeping their weight."""

    def process_weights_after_loading(self, layer):
        from vllm.platforms import current_platform

        if not (current_platform.is_cpu() and getattr(layer, "_cpu_skip_gemm_dispatch", False)):
            return original(self, layer)
        import vllm.model_executor.layers.utils as layer_utils

        # Looked up at call time, so the plugin's single-row padding wrapper applies.
        layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    return process_weights_after_loading


class TorchWithRowInvariantBmm(types.ModuleType):
    """torch, except that ``bmm`` is :func:`zero_mismatch_plugin.aligned.row_invariant.row_invariant_bmm`."""

    def __init__(self, torch_module):
        super().__init__(torch_module.__name__)
        self.__wrapped__ = torch_module

    def __getattr__(self, name):
        return getattr(self.__wrapped__, name)

    def bmm(self, batch1, batch2, *, out=None):
        from zero_mismatch_plugin.aligned.row_invariant import row_invariant_bmm

        return row_invariant_bmm(batch1, batch2, out=out)


def _row_invariant_bmm(original):
    return original if isinstance(original, TorchWithRowInvariantBmm) else TorchWithRowInvariantBmm(original)


def decode_on_one_thread(original):
    """``original`` (vLLM's CPU MLA decode kernel) run on one thread."""
    from zero_mismatch_plugin.aligned.row_invariant import on_one_thread

    return on_one_thread(original)


# The vllm-cpu-mla-one-token-prompt-decoded fork patch carries the source of these two functions.


def first_steps_counted_as_computed(num_computed_tokens, num_scheduled_tokens, decode_threshold):
    """Computed-token counts under which vLLM's decode/prefill reorder places a request's first
    step of at most ``decode_threshold`` tokens (a one-token prompt) with the later steps.

    ``reorder_batch_to_split_decodes_and_prefills`` puts every request with nothing computed at
    the back, among the prefills, and the MLA metadata builder counts decodes only up to the
    first query of another length: a one-token prompt was decoded alone, but prefilled, with
    other bits, when the reorder left a longer prompt before it. Counting such a step's own tokens
    as computed orders it as a decode (or, for a short first chunk of a longer prompt, a short
    extend) wherever it stands in the step. Other counts are returned unchanged.
    """
    import numpy as np

    computed = np.asarray(num_computed_tokens)
    scheduled = np.asarray(num_scheduled_tokens, dtype=computed.dtype)
    short_first_step = (computed == 0) & (scheduled <= decode_threshold)
    return np.where(short_first_step, scheduled, computed)


def only_cpu_mla_attention(attn_groups):
    """Whether every attention group of a model runner (``attn_groups``: one list per KV cache
    group) runs vLLM's CPU MLA backend, whose decode kernel computes a one-token prompt as it
    computes any later step."""
    groups = [group for kv_cache_group in attn_groups for group in kv_cache_group]
    return bool(groups) and all(group.backend.get_name() == "CPU_MLA" for group in groups)


class BatchWithComputedCounts:
    """A model runner's input batch as vLLM's decode/prefill reorder reads it, with other
    computed-token counts (read once, before any swap); every swap goes to the batch itself."""

    def __init__(self, input_batch, num_computed_tokens):
        self._input_batch = input_batch
        self.num_computed_tokens_cpu = num_computed_tokens

    def __getattr__(self, name):
        return getattr(self._input_batch, name)


def short_first_steps_decoded(original):
    """``GPUModelRunner._may_reorder_batch`` that, when every attention layer runs ``CPU_MLA``,
    orders a request's first step of at most the decode threshold (a one-token prompt) with the
    decodes, wherever it stands in the step."""

    def _may_reorder_batch(self, scheduler_output):
        threshold = self.reorder_batch_threshold
        if threshold is None or not only_cpu_mla_attention(self.attn_groups):
            return original(self, scheduler_output)
        from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills

        batch = self.input_batch
        scheduled = [scheduler_output.num_scheduled_tokens[req_id] for req_id in batch.req_ids]
        counted = first_steps_counted_as_computed(batch.num_computed_tokens_cpu[: len(scheduled)], scheduled,
                                                  threshold)
        reorder_batch_to_split_decodes_and_prefills(BatchWithComputedCounts(batch, counted), scheduler_output,
                                                    decode_threshold=threshold)

    return _may_reorder_batch


CPU_ROTARY_ON_ROWS = consistent_cpu_vllm_patch(
    f"{ROTARY_MODULE}:RotaryEmbedding.forward_cpu", rotary_on_rows, name="vllm-cpu-rotary-on-rows",
    why="_C.rotary_embedding reads q/k as [tokens, heads * head_size]; MLA's 3-D q[..., nope:] view is "
        "rotated with the wrong elements and positions, so rows depend on the batch")

CPU_MLA_KV_B_PROJ_GEMM = consistent_cpu_vllm_patch(
    f"{LINEAR_MODULE}:UnquantizedLinearMethod.process_weights_after_loading", gemm_dispatch_for_skipped_layers,
    name="vllm-cpu-mla-kv-b-proj-gemm",
    why="MLA's kv_b_proj runs aten F.linear on CPU, whose row bits depend on the row count")

CPU_MLA_DECODE_BMM = consistent_cpu_vllm_patch(
    f"{MLA_MODULE}:torch", _row_invariant_bmm, name="vllm-cpu-mla-decode-bmm",
    why="the absorbed MLA decode's torch.bmm takes other kernels for one and for 16+ decoding sequences than for 2-15")

CPU_MLA_DECODE_ONE_THREAD = consistent_cpu_vllm_patch(
    "vllm._custom_ops:mla_decode_kvcache_cpu", decode_on_one_thread, name="vllm-cpu-mla-decode-one-thread",
    why="_C.mla_decode_kvcache's output bits depend on the OpenMP thread count, so the trainer's "
        "bits depended on how many threads its process and the engine's worker had")

CPU_MLA_ONE_TOKEN_PROMPT_DECODED = consistent_cpu_vllm_patch(
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._may_reorder_batch", short_first_steps_decoded,
    name="vllm-cpu-mla-one-token-prompt-decoded",
    why="a one-token prompt was decoded alone or first among the step's new requests and prefilled after a "
        "longer prompt (other bits): 7 of 24 greedy logprobs equal to the prompt alone")

CONSISTENT_MODE_PATCHES = (CPU_ROTARY_ON_ROWS, CPU_MLA_KV_B_PROJ_GEMM, CPU_MLA_DECODE_BMM, CPU_MLA_DECODE_ONE_THREAD,
                           CPU_MLA_ONE_TOKEN_PROMPT_DECODED)
