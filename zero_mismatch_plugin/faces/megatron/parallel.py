"""Tensor and sequence parallelism of the Megatron face, with megatron-core's own collectives.

A rank of the face holds what the rank of the same index in a vLLM engine at the same
``tensor_parallel_size`` holds: the same query groups, the same MLP columns, the same vocabulary
rows. Each rank's GEMMs therefore have the engine rank's shapes and inputs. What crosses ranks:

* row-parallel outputs (``linear_proj``, ``linear_fc2``): one sum of the ranks' partials, as
  vLLM's all-reduce after its ``RowParallelLinear``; with two ranks the sum has one order;
* under sequence parallelism, gathers along tokens before column-parallel GEMMs and a
  reduce-scatter (the same one sum per element) after row-parallel ones; norms run on each
  rank's tokens, row by row as in the engine;
* the output layer's vocabulary shards, concatenated before the logprob (vLLM gathers its
  logits before ``compute_logprobs``; a vocab-parallel cross entropy is other arithmetic).

Why the layout must match the engine's: docs/megatron.md.
"""

from __future__ import annotations

import contextlib
import re

import torch


def tensor_parallel_group(config, tp_group=None):
    """The tensor-parallel group a module of ``config`` runs in; ``None`` at TP = 1."""
    if tp_group is not None:
        return tp_group if tp_group.size() > 1 else None
    if (getattr(config, "tensor_model_parallel_size", 1) or 1) == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def group_size(group) -> int:
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"aligned megatron spec: {what} ({total}) is not divisible by tensor parallelism {parts}")
    return total // parts


def uses_sequence_parallel(config, group) -> bool:
    return bool(getattr(config, "sequence_parallel", False)) and group is not None


def mark_partitioned(param: torch.nn.Parameter, dim: int) -> None:
    """megatron's tensor-parallel attributes on a sharded parameter (grad-norm, checkpoints)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def column_input(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel GEMM: every token on every rank (gathered along tokens
    under sequence parallelism), with the gradient summed over the ranks in the backward."""
    if group is None:
        return x
    from megatron.core.tensor_parallel import mappings

    with cpu_megatron_collectives():
        if sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, group=group)
        return mappings.copy_to_tensor_model_parallel_region(x, group=group)


def row_output(partial: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The ranks' partial outputs of a row-parallel GEMM summed (reduce-scattered along tokens
    under sequence parallelism). Two partials: megatron's all-reduce (one order exists); more:
    gathered and added in rank order, as the engine's patched all-reduce adds them
    (:mod:`..aligned.reductions`)."""
    if group is None:
        return partial
    if group.size() > 2:
        return _RankOrderReduce.apply(partial, group, sequence_parallel)
    from megatron.core.tensor_parallel import mappings

    with cpu_megatron_collectives():
        if sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, group=group)
        return mappings.reduce_from_tensor_model_parallel_region(partial, group=group)


class _RankOrderReduce(torch.autograd.Function):
    """Forward: every rank's partial gathered and summed in rank order (under sequence parallelism
    this rank's slice of tokens of the sum). Backward: megatron's, the gradient as it is (all-reduce)
    or gathered along tokens (reduce-scatter)."""

    @staticmethod
    def forward(ctx, partial, group, sequence_parallel):
        from zero_mismatch_plugin.aligned.reductions import all_gather_parts, rank_order_sum

        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        total = rank_order_sum(all_gather_parts(partial, group))
        if sequence_parallel:
            total = total.chunk(group.size(), dim=0)[group_rank(group)].contiguous()
        return total

    @staticmethod
    def backward(ctx, g):
        if not ctx.sequence_parallel:
            return g, None, None
        from zero_mismatch_plugin.aligned.reductions import all_gather_parts

        return torch.cat(all_gather_parts(g, ctx.group), dim=0), None, None


def linear_sharded_state_dict(module, prefix="", sharded_offsets=(), metadata=None):
    """A linear's ``sharded_state_dict`` (megatron's distributed checkpoint), as megatron's give
    theirs: ``partition_dim`` 0 as ``ColumnParallelLinear`` (weight and bias split along rows over
    the tensor-parallel ranks), 1 as ``RowParallelLinear`` (weight along columns, bias whole)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    axes = {"weight": module.partition_dim, **({"bias": 0} if module.partition_dim == 0 else {})}
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return make_sharded_tensors_for_checkpoint(
        module.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
        tp_group=module.tp_group, dp_cp_group=metadata["dp_cp_group"])


def vocab_shard_rows(runtime, vocab_size: int, tp: int) -> int:
    """The vocabulary rows of one tensor-parallel rank, refused unless they are the engine rank's.

    vLLM's lm_head pads the vocabulary to a multiple of 64 and splits the padded rows evenly;
    megatron splits the vocabulary itself evenly. Both agree when no padding is needed.
    """
    if tp == 1:
        return vocab_size
    padded = runtime.padded_vocab_size(vocab_size)
    if padded != vocab_size:
        raise NotImplementedError(
            f"aligned output layer: vocabulary {vocab_size} under tensor parallelism {tp}: vLLM pads it to "
            f"{padded} rows before splitting them over its ranks, megatron splits {vocab_size}; the ranks "
            "would hold different rows. Use a checkpoint whose vocabulary is a multiple of 64, or TP 1"
        )
    return divide(vocab_size, tp, "vocabulary size")


def gather_vocab(logits: torch.Tensor, group) -> torch.Tensor:
    """The ranks' vocabulary shards of the logits, concatenated along the last dim in rank order."""
    if group is None:
        return logits
    from megatron.core.tensor_parallel import mappings

    with cpu_megatron_collectives():
        return mappings.gather_from_tensor_model_parallel_region(logits, group=group)


@contextlib.contextmanager
def cpu_megatron_collectives():
    """megatron-core 0.16's gathers allocate their outputs on ``torch.cuda.current_device()``;
    on a CPU-only machine they get the CPU for the call (a no-op with CUDA)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


# ----- Checkpoint shards -------------------------------------------------------------------

# How each megatron tensor is split over tensor-parallel ranks: rows, columns, or fc1's
# [gate; up] halves split each (megatron keeps [gate_r; up_r] on rank r, as vLLM's merged
# column-parallel linear does). Anything else is replicated.
_ROW_SHARDED = ("linear_qkv.weight", "linear_qkv.bias", "embedding.word_embeddings.weight", "output_layer.weight")
_COLUMN_SHARDED = ("linear_proj.weight", "linear_fc2.weight")
_HALVES_SHARDED = ("linear_fc1.weight",)


def shard_layout(name: str, experts_split: bool = False) -> str | None:
    """``"rows"``, ``"columns"``, ``"halves"`` or ``None`` (replicated) for a megatron name. Routed
    experts are split as MLPs are when ``experts_split`` (expert tensor parallelism = tensor
    parallelism, vLLM's tensor-parallel experts), else whole on their rank."""
    if _LOCAL_EXPERT.match(name) and not experts_split:
        return None
    if name.endswith(_HALVES_SHARDED):
        return "halves"
    if name.endswith(_ROW_SHARDED):
        return "rows"
    if name.endswith(_COLUMN_SHARDED):
        return "columns"
    return None


def shard(name: str, full: torch.Tensor, rank: int, size: int, experts_split: bool = False) -> torch.Tensor:
    """Rank ``rank``'s part of the full megatron tensor ``name``."""
    layout = shard_layout(name, experts_split)
    if size == 1 or layout is None:
        return full
    if layout == "rows":
        return full.chunk(size, dim=0)[rank]
    if layout == "columns":
        return full.chunk(size, dim=1)[rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])


def unshard(name: str, parts: list[torch.Tensor], experts_split: bool = False) -> torch.Tensor:
    """The full megatron tensor ``name`` from every rank's part (inverse of :func:`shard`)."""
    layout = shard_layout(name, experts_split)
    if len(parts) == 1 or layout is None:
        return parts[0]
    if layout == "rows":
        return torch.cat(parts, dim=0)
    if layout == "columns":
        return torch.cat(parts, dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def gather_full(name: str, local: torch.Tensor, group, experts_split: bool = False) -> torch.Tensor:
    """The full tensor ``name`` on every rank of ``group`` from each rank's part."""
    from zero_mismatch_plugin.aligned.reductions import all_gather_parts

    if group is None or shard_layout(name, experts_split) is None:
        return local
    return unshard(name, all_gather_parts(local, group), experts_split)


def experts_split(config) -> bool:
    """Whether a model of ``config`` splits each routed expert over the tensor-parallel ranks."""
    return (getattr(config, "expert_tensor_parallel_size", 1) or 1) > 1


# ----- Experts over expert-parallel ranks ---------------------------------------------------

# A routed expert's tensors: megatron numbers a rank's experts from 0 (its local experts).
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def layout_group(config, size: str, getter: str):
    """megatron's process group of one parallel dimension of ``config`` (``size``: its
    TransformerConfig field; ``getter``: megatron's ``parallel_state`` function); ``None`` at size 1."""
    if (getattr(config, size, 1) or 1) == 1:
        return None
    from megatron.core import parallel_state

    return getattr(parallel_state, getter)()


def expert_parallel_group(config):
    """The expert-parallel group of a model of ``config``; ``None`` at expert parallelism 1."""
    return layout_group(config, "expert_model_parallel_size", "get_expert_model_parallel_group")


def _experts_of(num_experts: int, group, rank: int) -> range:
    from zero_mismatch_plugin.aligned.expert_parallel import local_experts

    return local_experts(num_experts, group_size(group), rank)


def local_experts_of(tensors: dict, num_experts: int, group) -> dict:
    """The tensors this expert-parallel rank holds, from full ones (experts under global
    numbers): its routed experts (megatron's contiguous share) renumbered from 0, the rest as is."""
    if group is None:
        return tensors
    mine = _experts_of(num_experts, group, group_rank(group))
    out = {}
    for name, tensor in tensors.items():
        match = _LOCAL_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        elif int(match.group(2)) in mine:
            out[f"{match.group(1)}{int(match.group(2)) - mine.start}{match.group(3)}"] = tensor
    return out


def gather_experts(tensors: dict, num_experts: int, group) -> dict:
    """Every rank's routed experts under their global numbers, on every rank of ``group`` (a
    collective: all ranks call it with the same names); other tensors as they are."""
    from zero_mismatch_plugin.aligned.reductions import all_gather_parts

    if group is None:
        return tensors
    per = len(_experts_of(num_experts, group, 0))
    out = {}
    for name, tensor in tensors.items():
        match = _LOCAL_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        for rank, part in enumerate(all_gather_parts(tensor, group)):
            out[f"{match.group(1)}{rank * per + int(match.group(2))}{match.group(3)}"] = part
    return out
