"""The functions that the vLLM GPU fork patches insert into vLLM and that the plugin does not run itself.

They are inserted as source (``inspect.getsource``), so each is self-contained: standard library only,
imports inside the body, no plugin names.
"""

from __future__ import annotations


def reduce_scatterv_in_rank_order(input_, group, sizes, rank):
    """Reduce-scatter along dim 0 that sums the ranks' contributions in rank order 0, 1, 2, ...

    ``input_`` holds ``sum(sizes)`` rows on every rank of ``group``; ``rank`` (its index in
    the group) gets the sum over all ranks of rows ``[offset, offset + sizes[rank])``. Every
    contribution is first placed in a slot indexed by its source rank (an all-gather), then
    the slots are added left to right, so the bits of the result do not depend on which rank's
    data arrived first. It moves world-size times the data of a reduce-scatter.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    input_ = input_.contiguous()
    gathered = [input_.new_empty(input_.shape) for _ in range(world_size)]
    dist.all_gather(gathered, input_, group=group)
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    output = gathered[0][start:stop].clone()
    for contribution in gathered[1:]:
        output += contribution[start:stop]
    return output


def last_write_per_slot(destinations):
    """Positions of the writes to keep so every destination slot is written once in a step.

    For each distinct destination the last write in submission order is kept: what running
    the writes one after another would leave. Positions come back in submission order.
    """
    last = {}
    for position, destination in enumerate(destinations):
        last[int(destination)] = position
    return sorted(last.values())
