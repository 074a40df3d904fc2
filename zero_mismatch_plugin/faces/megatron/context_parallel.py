"""Context parallelism of the Megatron face: each rank's queries, every rank's keys and values.

megatron's split (as verl packs a batch for it and megatron's ``get_batch_on_this_cp_rank`` cuts
it): each sequence is padded at its end to a multiple of ``2 * CP`` tokens and cut into ``2 * CP``
chunks; rank r holds chunks r and ``2 * CP - 1 - r`` (so that causal work is balanced), sequence
after sequence. ``PackedSeqParams`` keeps the whole (padded) lengths.

In the attention, the keys and values of every rank are gathered into sequence order and the
rank's query rows attend them through vLLM's attention backend as a chunked prefill does: each
chunk is a request whose queries are its rows and whose context is its sequence up to its last
row (:meth:`..aligned.attention_backend.BackendPagedAttention.metadata`). The engine computes a
later chunk of a prompt the same way when it finds the earlier part in its prefix cache; the
suite's prefix-caching tests hold both forms to the same bits. Every other layer works on rows.

The backward gathers the queries and the output gradients too and runs the one-process analytic
backward of the whole sequences on every rank, keeping the rank's rows: exact, but the attention
backward is not split (the forward is).
"""

from __future__ import annotations

import dataclasses

import torch

from zero_mismatch_plugin.aligned.ops import observable
from zero_mismatch_plugin.faces.megatron.parallel import layout_group


def context_parallel_group(config):
    """The context-parallel group of a model of ``config``; ``None`` at context parallelism 1."""
    return layout_group(config, "context_parallel_size", "get_context_parallel_group")


def padded_length(n: int, size: int) -> int:
    """``n`` tokens padded at the end to a multiple of ``2 * size`` (megatron's chunking)."""
    return -(-n // (2 * size)) * 2 * size


@dataclasses.dataclass(frozen=True)
class Split:
    """How packed sequences of (padded) lengths ``seq_lens`` are split over ``size`` ranks."""

    seq_lens: tuple[int, ...]
    size: int

    def __post_init__(self):
        bad = [n for n in self.seq_lens if n % (2 * self.size)]
        if bad:
            raise ValueError(f"context parallelism {self.size}: sequence lengths {bad} are not multiples of "
                             f"{2 * self.size} (pad each sequence to a multiple of 2 x context_parallel_size)")

    def chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """Rank ``rank``'s chunks in its row order: ``(sequence, first row, end row)`` within each sequence."""
        out = []
        for index, n in enumerate(self.seq_lens):
            width = n // (2 * self.size)
            for chunk in (rank, 2 * self.size - 1 - rank):
                out.append((index, chunk * width, (chunk + 1) * width))
        return out

    def rows(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows as indices into the packed whole batch, in the rank's order."""
        starts = [0]
        for n in self.seq_lens[:-1]:
            starts.append(starts[-1] + n)
        return torch.cat([torch.arange(starts[i] + a, starts[i] + b) for i, a, b in self.chunks(rank)])

    def positions(self, rank: int) -> torch.Tensor:
        """The positions (within their sequence) of rank ``rank``'s rows."""
        return torch.cat([torch.arange(a, b) for _, a, b in self.chunks(rank)])

    def whole(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The packed whole batch from every rank's rows (``parts`` in rank order)."""
        total = sum(self.seq_lens)
        out = parts[0].new_empty((total, *parts[0].shape[1:]))
        for rank, part in enumerate(parts):
            out[self.rows(rank).to(part.device)] = part
        return out


def gather_whole(local: torch.Tensor, split: Split, group) -> torch.Tensor:
    """Every rank's rows of ``local``, as the packed whole batch (a collective, no gradient)."""
    from zero_mismatch_plugin.aligned.reductions import all_gather_parts

    return split.whole(all_gather_parts(local.contiguous(), group))


class GatherRows(torch.autograd.Function):
    """Forward: the packed whole batch from every rank's rows. Backward: this rank's rows of the
    gradient (each rank back-propagates its own rows; the parameters' gradients meet in megatron's
    data-and-context-parallel all-reduce)."""

    @staticmethod
    def forward(ctx, local, split: Split, group):
        ctx.rows = split.rows(torch.distributed.get_rank(group))
        return gather_whole(local, split, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rows.to(grad.device)], None, None


class ContextParallelAttention(torch.autograd.Function):
    """This rank's query rows through vLLM's attention over the gathered keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, attention, split: Split, group):
        rank = torch.distributed.get_rank(group)
        k_whole, v_whole = gather_whole(k, split, group), gather_whole(v, split, group)
        plan = attention.kernel.metadata(list(split.seq_lens), queries=split.chunks(rank))
        out = attention.kernel(q, k_whole, v_whole.contiguous(), plan)
        ctx.save_for_backward(q, k_whole, v_whole)
        ctx.attention, ctx.split, ctx.group, ctx.rows = attention, split, group, split.rows(rank)
        return out

    @staticmethod
    def backward(ctx, g):
        from zero_mismatch_plugin.aligned.ops import attention_backward

        q, k_whole, v_whole = ctx.saved_tensors
        a, split, group = ctx.attention, ctx.split, ctx.group
        q_whole, g_whole = gather_whole(q, split, group), gather_whole(g.contiguous(), split, group)
        gq, gk, gv = attention_backward(q_whole, k_whole, v_whole, g_whole, list(split.seq_lens), a.num_heads,
                                        a.num_kv_heads, a.head_dim, a.scale, a.sliding_window)
        rows = ctx.rows.to(g.device)
        return gq[rows].to(q.dtype), gk[rows].to(q.dtype), gv[rows].to(q.dtype), None, None, None


class ContextParallelAttentionOp:
    """:class:`ContextParallelAttention` of one layer's attention as one op of the op layer: what
    the bisect recorder sees as the layer's ``attn`` (this rank's rows of it)."""

    recorded_as = "attn"

    def __init__(self, attention):
        self.attention = attention

    @observable
    def __call__(self, q, k, v, split: Split, group):
        return ContextParallelAttention.apply(q, k, v, self.attention, split, group)
