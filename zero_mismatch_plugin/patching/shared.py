"""Functions that exist both in the plugin and, as source text, inside the upstream patches.

The patch generator (:mod:`.edits`) inserts the source of these functions into the patched
upstream files with :func:`inspect.getsource`, and the plugin calls the same functions at
run time, so the patched fork and the plugin cannot disagree. Each function is therefore
self-contained: standard library only, imports inside the body, no plugin names.
"""

from __future__ import annotations


def require_registered_name(key, name, registry, kind):
    """Raise ``ValueError`` naming the config ``key`` when ``name`` is not in ``registry``.

    A plugin's names exist once its ``verl.plugins`` entry point has loaded (``import verl``
    loads them all), so an unknown name at config time is a typo or a plugin that failed.
    """
    value = getattr(name, "value", name)
    if value not in registry:
        raise ValueError(
            f"{key}={value!r} is not a registered {kind}; registered: {sorted(registry)}. "
            "Names from a plugin exist only after its verl.plugins entry point loaded without error."
        )
    return value


def accepts_keyword(fn, name):
    """Whether ``fn`` can be called with the keyword argument ``name``."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return True
        if parameter.name == name and parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            return True
    return False


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
