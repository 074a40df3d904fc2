"""``zmrl bisect`` at a Megatron layout: every rank's op records, and the rows each rank holds.

Each rank runs the Megatron face's forward with the op layer recorded, as the one-process backend
records it (:class:`.recording.OpRecorder`), and reports what it computed: a pipeline stage the ops
of its own layers (the first stage's layer 0 reads the embedding, the last stage adds the final norm
and the head), an expert- or data-parallel rank every op of the whole batch (its experts' rows
reach it through megatron's token dispatcher; the combine's output is whole), a context-parallel
rank its chunks' rows. :func:`.bisect.compare_rank_records` cuts vLLM's one-process records to
each rank's rows and names the first op, in execution order, that differs on some rank, and the
ranks it differs on.

A tensor-parallel rank computes the engine rank's shards, which vLLM's one-process modules do not:
at tensor parallelism every rank also builds vLLM's model as the engine's rank of its index builds
it (:class:`.engine_modules.EngineModules` on the ranks) and records the same batch, and the rank is
compared with those records (a row-parallel linear's partial output before the all-reduce on both
sides; under sequence parallelism the ops outside the column- to row-parallel span hold the rank's
slice of the tokens). With pipeline or context parallelism too, vLLM's model on a rank is the
whole model at the engine rank of its tensor-parallel index, and the rank is compared on its
stage's ops and its chunks' rows (under sequence parallelism, its share of them). Tensor parallelism
is not bisected with expert parallelism.
"""

from __future__ import annotations

import dataclasses

import torch

from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.recording import OpRecorder

# A rank's rows that are none of the batch's (megatron's padding).
PADDING = -1
BISECT_AT_TENSOR_PARALLEL = (
    "zmrl bisect at --tensor-parallel N builds, on each rank, vLLM's model as the engine rank of its "
    "tensor-parallel index, so every rank must be one: with --pipeline-parallel, --context-parallel and "
    "--expert-parallel up to N (experts on the tensor-parallel ranks), not with data-parallel ranks beside "
    "them")
# Called on the ranks by RankGroup.call (a "module:function" of this package).
RANK_CALL = f"{__name__}:op_records"


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """One rank's records: ``ops`` {name: value} in execution order, and ``rows``: the batch row
    of each row those values hold (:data:`PADDING` for padding; None: row i is batch row i). The
    head's values (logits, logprobs) are whole, one row per scored token, on the ranks that hold it."""

    rank: int
    ops: dict
    rows: torch.Tensor | None = None
    # At tensor parallelism, vLLM's records of the same batch on this rank (the engine rank of its
    # index); None: compared with vLLM's one-process records.
    engine_ops: dict | None = None
    # Under sequence parallelism with context parallelism: the batch row of each row the ops between
    # a column-parallel gather and a row-parallel reduce hold (the rank's chunks; ``rows`` is its
    # tensor-parallel share of them). None: those ops hold rows 0, 1, ... of the padded batch.
    group_rows: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class OneUlpOnRank:
    """A difference planted on one rank: the first value of op ``op`` moved one ulp up, on world
    rank ``rank`` only (how the bisector's own tests see that it names the op and the rank)."""

    op: str
    rank: int

    def on(self, rank: int):
        """The recorder's ``perturb`` for world rank ``rank`` (None where nothing is planted)."""
        if rank != self.rank:
            return None

        def one_ulp(name, value):
            if name != self.op:
                return value
            out = value.clone()
            flat = out.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
            return out

        return one_ulp


def layer_of(name: str) -> int | None:
    """The decoder layer an op name belongs to (``layers.3.qkv_proj`` -> 3), None for a model-level op."""
    head, _, rest = name.partition(".")
    if head != "layers":
        return None
    return int(rest.split(".", 1)[0])


def stage_order(order: list[str], layers: range, first: bool, last: bool) -> list[str]:
    """The ops of ``order`` a pipeline stage runs: those of its ``layers``, the embedding on the
    first stage, the final norm and the head on the last."""
    def runs(name: str) -> bool:
        layer = layer_of(name)
        if layer is not None:
            return layer in layers
        return first if name == oplist.EMBED else last

    return [name for name in order if runs(name)]


def context_parallel_batch_rows(batch, group, tokens_multiple_of: int = 1) -> torch.Tensor:
    """The batch row of each of this context-parallel rank's rows (:data:`PADDING` for megatron's
    padding at the end of each sequence; ``tokens_multiple_of`` as the forward padded)."""
    from zero_mismatch_plugin.integrations.megatron.standalone import context_parallel_rows

    split, real = context_parallel_rows(batch, group.size(), tokens_multiple_of)
    of_padded = torch.full((sum(split.seq_lens),), PADDING, dtype=torch.long)
    of_padded[real] = torch.arange(batch.num_tokens)
    return of_padded[split.rows(torch.distributed.get_rank(group))]


def sequence_parallel_rows(num_rows: int, group) -> torch.Tensor:
    """The rows a sequence-parallel rank holds of the ``num_rows`` padded rows (megatron's even split)."""
    size, rank = group.size(), torch.distributed.get_rank(group)
    per_rank = num_rows // size
    return torch.arange(rank * per_rank, (rank + 1) * per_rank)


@torch.no_grad()
def op_records(spec, batch, order: list[str], planted: OneUlpOnRank | None = None,
               engine_settings=None) -> list[RankRecord]:
    """On every rank of a :class:`~zero_mismatch_plugin.integrations.megatron.rank_group.RankGroup`:
    this rank's records of ``batch`` (``order``: the canonical op list of the whole model), then
    every rank's, in rank order. At tensor parallelism ``engine_settings`` (the checker's
    :class:`.engine.EngineSettings`) builds vLLM's model on the ranks for each rank's reference."""
    from megatron.core import parallel_state

    from zero_mismatch_plugin.faces.megatron import context_parallel, pipeline
    from zero_mismatch_plugin.integrations.megatron.distributed import built_model

    run = built_model(spec)
    config = run.model.config
    world_rank = torch.distributed.get_rank()
    stages = pipeline.pipeline_size(config)
    stage = torch.distributed.get_rank(pipeline.pipeline_group(config)) if stages > 1 else 0
    last = stage == stages - 1
    mine = stage_order(order, pipeline.stage_layers(config), first=stage == 0, last=last)
    with OpRecorder(None if planted is None else planted.on(world_rank)) as recorder:
        with recorder.op_layer(mine):
            out = run.outputs(batch)
        if last:
            recorder.keep_head(out["target_logits"])
    cp_group = context_parallel.context_parallel_group(config)
    rows = None if cp_group is None else context_parallel_batch_rows(batch, cp_group, run.multiple)
    engine_ops = group_rows = None
    if run.layout.tensor_model_parallel_size > 1:
        engine_ops = _engine_rank_records(engine_settings, batch)
        if run.layout.sequence_parallel:
            tp_group = parallel_state.get_tensor_model_parallel_group()
            if rows is None:
                padded = batch.num_tokens + (-batch.num_tokens % run.multiple)
                rows = sequence_parallel_rows(padded, tp_group)
            else:  # the context-parallel rank's rows, split again over its tensor-parallel ranks
                group_rows, rows = rows, rows[sequence_parallel_rows(len(rows), tp_group)]
    record = RankRecord(world_rank, {name: _on_cpu(value) for name, value in recorder.ops.items()}, rows, engine_ops,
                        group_rows)
    records = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, record)
    return records


def _engine_rank_records(settings, batch) -> dict:
    """vLLM's model built on this rank as the engine's tensor-parallel rank of its index builds it,
    and its records of ``batch`` (after the trainer's forward: vLLM's groups exist only meanwhile)."""
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    if settings is None:
        raise ValueError("at tensor parallelism op_records needs the checker's engine settings")
    record: dict = {}
    with EngineModules(settings, on_ranks=True) as modules:
        _same_tensor_parallel_ranks()
        modules.forward(batch, record)
    return {name: _on_cpu(value) for name, value in record.items()}


def _same_tensor_parallel_ranks() -> None:
    """vLLM's tensor-parallel group on this rank is megatron's: the rank's reference is the engine
    rank of its own index among the ranks it shares its shards with."""
    from megatron.core import parallel_state as megatron_groups
    from vllm.distributed import parallel_state as vllm_groups

    trainer = torch.distributed.get_process_group_ranks(megatron_groups.get_tensor_model_parallel_group())
    engine = list(vllm_groups.get_tp_group().ranks)
    if list(trainer) != engine:
        raise RuntimeError(f"rank {torch.distributed.get_rank()}: megatron's tensor-parallel ranks {trainer} are not "
                           f"vLLM's {engine}; bisect needs megatron's default rank order (tensor-parallel ranks "
                           "consecutive)")


def _on_cpu(value):
    if isinstance(value, tuple):
        return tuple(v.cpu() for v in value)
    return value.cpu()
