"""``zmrl bisect``: the first op whose output differs between vLLM's modules and the trainer's.

Both sides run the same teacher-forced input and report every op under the names of :mod:`.oplist`;
compared in execution order, the first op not bitwise equal (non-finite values fail) is named and
what follows is reported, not blamed. No engine is started: vLLM's model is built in this process
(:mod:`.engine_modules`). At a Megatron layout each rank's records are compared with the rows it
holds (:mod:`.rank_records`), and the ranks the first difference is on are named too. See
docs/alignment-playbook.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_mismatch_plugin.tools.checker import oplist


@dataclass
class BisectResult:
    first_differing_op: str | None
    ops: list[oplist.OpComparison]
    not_compared: list[str] = field(default_factory=list)
    tokens: int = 0
    target_tokens: int = 0
    layout: str | None = None  # a Megatron layout's name, when the trainer ran on ranks

    @property
    def first(self) -> oplist.OpComparison | None:
        for op in self.ops:
            if op.name == self.first_differing_op:
                return op
        return None

    def as_dict(self) -> dict:
        first = self.first
        return {
            "pass": self.first_differing_op is None,
            "first_differing_op": self.first_differing_op,
            **({} if self.layout is None else {
                "layout": self.layout, "first_differing_ranks": first.differing_ranks if first else []}),
            "max_abs_diff": first.max_abs_diff if first else 0.0,
            "equal_fraction": first.equal_fraction if first else 1.0,
            "problem": first.problem if first else None,
            "ops_compared": len(self.ops),
            "ops_differing": sum(not op.equal for op in self.ops),
            "not_compared": self.not_compared,
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "ops": [op.as_dict() for op in self.ops],
        }


def bisect_input(prompts: list[list[int]], response_tokens: int, vocab_size: int, seed: int = 0):
    """Packed prompts + fixed pseudo-random responses (any tokens do: the forward is teacher
    forced, and only the same input on both sides matters)."""
    from zero_mismatch_plugin.aligned import pack

    gen = torch.Generator().manual_seed(seed)
    responses = [
        torch.randint(0, vocab_size, (response_tokens,), generator=gen).tolist() for _ in prompts
    ]
    return pack(prompts, responses)


def compare_intermediates(order: list[str], engine: dict, trainer: dict) -> BisectResult:
    ops, missing, first = [], [], None
    for name in order:
        if name not in engine or name not in trainer:
            missing.append(name)
            continue
        result = oplist.compare_op(name, engine[name], trainer[name])
        ops.append(result)
        if first is None and not result.equal:
            first = name
    return BisectResult(first_differing_op=first, ops=ops, not_compared=missing)


def rank_rows_compared(engine_value, record, name: str, num_tokens: int):
    """``(engine rows, rank rows)``: op ``name``'s values as [rows, features] (:func:`.oplist.as_rows`)
    on the rows the rank of ``record`` (a :class:`.rank_records.RankRecord`) holds of the batch's
    ``num_tokens`` tokens (megatron's padding left out); the head's rows are whole on each rank."""
    from zero_mismatch_plugin.tools.checker.rank_records import PADDING

    engine = oplist.as_rows(engine_value)
    value = record.ops[name]
    held = oplist.numel(value) // max(1, engine.shape[1])
    mine = oplist.as_rows(value, held) if held * engine.shape[1] == oplist.numel(value) else None
    if mine is None or name in (oplist.LOGITS, oplist.LOGPROBS):
        return engine, mine if mine is not None else value  # whole (a shape mismatch is reported as such)
    # Under sequence parallelism the ops between a column-parallel gather and a row-parallel
    # reduce hold every row (their features split): more rows than the rank's own.
    whole = record.rows is None or held > len(record.rows)
    if not whole:
        rows = record.rows[:held]
    else:
        rows = torch.arange(held) if record.group_rows is None else record.group_rows[:held]
    rows = torch.where(rows < num_tokens, rows, PADDING)
    kept = (rows != PADDING).nonzero().squeeze(1)
    return engine.index_select(0, rows[kept]), mine.index_select(0, kept)


def reference_of(name: str, record, engine: dict, records: list):
    """What ``record``'s rank is compared with for op ``name``: vLLM's records on that rank (at
    tensor parallelism; a whole value, the head's, from any rank holding it), else vLLM's
    one-process records; None where neither has the op."""
    if record.engine_ops is None:
        return engine.get(name)
    if name in record.engine_ops:
        return record.engine_ops[name]
    return next((r.engine_ops[name] for r in records if r.engine_ops and name in r.engine_ops), None)


def compare_rank_records(order: list[str], engine: dict, records: list, num_tokens: int) -> BisectResult:
    """Each rank's records against vLLM's records of the same ``num_tokens``-token batch (see
    :func:`reference_of`), cut to the rows the rank holds; an op differs where it differs on some
    rank (its row in the result is that rank's comparison, with every rank that differs)."""
    ops, missing, first = [], [], None
    for name in order:
        holders = [record for record in records if name in record.ops]
        references = [reference_of(name, record, engine, records) for record in holders]
        if not holders or any(reference is None for reference in references):
            missing.append(name)
            continue
        compared = []
        for record, reference in zip(holders, references):
            reference, candidate = rank_rows_compared(reference, record, name, num_tokens)
            compared.append((record.rank, oplist.compare_op(name, reference, candidate)))
        differing = [rank for rank, comparison in compared if not comparison.equal]
        shown = next((c for rank, c in compared if rank in differing), compared[0][1])
        shown.ranks, shown.differing_ranks = [rank for rank, _ in compared], differing
        ops.append(shown)
        if first is None and differing:
            first = name
    return BisectResult(first_differing_op=first, ops=ops, not_compared=missing)


def run_bisect(engine_modules, backend, batch, perturb=None) -> BisectResult:
    """Run both sides on ``batch`` and compare every op (``perturb`` goes to the trainer; at a
    layout, a :class:`.rank_records.OneUlpOnRank`)."""
    engine_record: dict = {}
    engine_modules.forward(batch, engine_record)
    order = engine_modules.op_names()
    rank_records = getattr(backend, "rank_records", None)
    if rank_records is not None:
        result = compare_rank_records(order, engine_record, rank_records(batch, order, perturb), batch.num_tokens)
        result.layout = backend.layout.name
    else:
        result = compare_intermediates(order, engine_record, backend.intermediates(batch, perturb=perturb))
    result.tokens = batch.num_tokens
    result.target_tokens = int(batch.target_ids.numel())
    return result
