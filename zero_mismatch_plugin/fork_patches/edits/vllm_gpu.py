"""The edits of the vLLM fork patches for GPU engines (expert-parallel combine, ROCm GEMM, Mamba state slots)."""

from __future__ import annotations

from zero_mismatch_plugin.fork_patches.edits.edit import Edit, source_of
from zero_mismatch_plugin.fork_patches.edits.vllm_gpu_functions import (
    last_write_per_slot,
    reduce_scatterv_in_rank_order,
)

ALL2ALL = "vllm/distributed/device_communicators/all2all.py"

VLLM_EP_COMBINE_RANK_ORDER = [
    Edit(
        ALL2ALL,
        old="""\
        hidden_states = dist_group.reduce_scatterv(hidden_states, dim=0, sizes=sizes)
        return hidden_states

    def destroy(self):
        pass


class DeepEPAll2AllManagerBase(All2AllManagerBase):
""",
        new="""\
        if envs.VLLM_BATCH_INVARIANT and dist_group.world_size > 1:
            # The expert outputs of all ranks are summed in rank order, not in the order
            # the backend's reduce-scatter (or a custom one) happens to receive them, so the
            # combined hidden states have the same bits whatever the arrival order.
            return reduce_scatterv_in_rank_order(
                hidden_states, dist_group.device_group, sizes, dist_group.rank_in_group
            )
        hidden_states = dist_group.reduce_scatterv(hidden_states, dim=0, sizes=sizes)
        return hidden_states

    def destroy(self):
        pass


""" + source_of(reduce_scatterv_in_rank_order) + """\


class DeepEPAll2AllManagerBase(All2AllManagerBase):
""",
    ),
]

GEMM_UTILS = "vllm/model_executor/layers/utils.py"
BATCH_INVARIANT = "vllm/model_executor/determinism/batch_invariant.py"

VLLM_ROCM_SHAPE_INDEPENDENT_GEMM = [
    Edit(
        GEMM_UTILS,
        old="""\
    from vllm.platforms.rocm import on_gfx1x, on_gfx9, on_gfx950, on_gfx1250

    n = x.numel() // x.size(-1)
""",
        new="""\
    from vllm.platforms.rocm import on_gfx1x, on_gfx9, on_gfx950, on_gfx1250

    if envs.VLLM_BATCH_INVARIANT:
        # Every branch below picks its kernel (skinny GEMMs, AITER, hipBLASLt through
        # tgemm or F.linear) by the row count, and hipBLASLt picks its tile by it too (a
        # different one at 4,096 rows than at 4,097). In batch-invariant mode all unquantized
        # linears, the sparse-attention indexer's included, take one Triton kernel whose tile
        # configuration depends on the dtype only.
        from vllm.model_executor.determinism.batch_invariant import (
            linear_batch_invariant,
        )

        return linear_batch_invariant(x, weight, bias)

    n = x.numel() // x.size(-1)
""",
    ),
    Edit(
        BATCH_INVARIANT,
        old="""\
    elif current_platform.is_xpu():
        # Tensor descriptors need a global-memory allocator; must be set outside
""",
        new="""\
    elif current_platform.is_rocm():
        # hipBLASLt chooses tiles by the row count (4,096 and 4,097 rows differ), so
        # mm / addmm / matmul / linear issued by the trainer's forward take the persistent
        # Triton matmul, as on SM80; bmm is replaced below on every platform but XPU.
        _batch_invariant_LIB.impl("aten::mm", mm_batch_invariant, key)
        _batch_invariant_LIB.impl("aten::addmm", addmm_batch_invariant, key)
        _batch_invariant_LIB.impl("aten::matmul", matmul_batch_invariant, key)
        _batch_invariant_LIB.impl("aten::linear", linear_batch_invariant, key)
    elif current_platform.is_xpu():
        # Tensor descriptors need a global-memory allocator; must be set outside
""",
    ),
]

MAMBA_UTILS = "vllm/v1/worker/mamba_utils.py"

VLLM_MAMBA_STATE_SLOT_WRITES_ONCE = [
    Edit(
        MAMBA_UTILS,
        old="""\
def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
    n = copy_bufs.offset
    if n == 0:
        return
""",
        new="""\
def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
    n = copy_bufs.offset
    if n == 0:
        return
    # batch_memcpy runs the copies in parallel, in no fixed order. After a wake-up (KV cache
    # reset, requests force-preempted and resumed) an evicted request's state and a reused
    # one can target the same state slot in one step; the slot would then hold whichever
    # write landed last. Keep one write per destination slot: the last in request order.
    keep = last_write_per_slot(copy_bufs.dst_ptrs.np[:n])
    if len(keep) != n:
        for buffer in (copy_bufs.src_ptrs, copy_bufs.dst_ptrs, copy_bufs.sizes):
            buffer.np[: len(keep)] = buffer.np[:n][keep]
        n = copy_bufs.offset = len(keep)
""",
    ),
    Edit(
        MAMBA_UTILS,
        old="""\


def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
""",
        new="""\


""" + source_of(last_write_per_slot) + """\


def do_mamba_copy_block(copy_bufs: MambaCopyBuffers):
""",
    ),
]

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {
    "vllm-ep-combine-rank-order": VLLM_EP_COMBINE_RANK_ORDER,
    "vllm-rocm-shape-independent-gemm": VLLM_ROCM_SHAPE_INDEPENDENT_GEMM,
    "vllm-mamba-state-slot-writes-once": VLLM_MAMBA_STATE_SLOT_WRITES_ONCE,
}
