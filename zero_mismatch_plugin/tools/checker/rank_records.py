"""``zmrl bisect`` at a Megatron layout: every rank's op records, and the rows each rank holds.

Each rank runs the Megatron face's forward with the op layer recorded, as the one-process backend
records it (:class:`.recording.OpRecorder`), and reports what it computed: a pipeline stage the ops
of its own layers (the first stage's layer 0 reads the embedding, the last stage adds the final norm
and the head), an expert- or data-parallel rank every op of the whole batch (its experts' rows
reach it through megatron's token dispatcher; the combine's output is whole), a context-parallel
rank its chunks' rows. :func:`.bisect.compare_rank_records` cuts vLLM's one-process records to
each rank's rows and names the first op, in execution order, that differs on some rank, and the
ranks it differs on.

Tensor parallelism is not covered: a tensor-parallel rank computes the engine rank's shards, and
vLLM's modules run here in one process (``zmrl check --tensor-parallel N`` compares it with an
engine at the same tensor parallelism).
"""

from __future__ import annotations

import dataclasses

import torch

from zero_mismatch_plugin.tools.checker import oplist
from zero_mismatch_plugin.tools.checker.recording import OpRecorder

# A rank's rows that are none of the batch's (megatron's padding).
PADDING = -1
BISECT_AT_TENSOR_PARALLEL = (
    "zmrl bisect runs vLLM's modules in one process, and a tensor-parallel rank computes the engine rank's "
    "shards: bisect at --expert-parallel, --pipeline-parallel or --context-parallel (or in one process), and "
    "compare tensor parallelism with zmrl check --tensor-parallel N")
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


@torch.no_grad()
def op_records(spec, batch, order: list[str], planted: OneUlpOnRank | None = None) -> list[RankRecord]:
    """On every rank of a :class:`~zero_mismatch_plugin.integrations.megatron.rank_group.RankGroup`:
    this rank's records of ``batch`` (``order``: the canonical op list of the whole model), then
    every rank's, in rank order."""
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
    record = RankRecord(world_rank, {name: _on_cpu(value) for name, value in recorder.ops.items()}, rows)
    records = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, record)
    return records


def _on_cpu(value):
    if isinstance(value, tuple):
        return tuple(v.cpu() for v in value)
    return value.cpu()
