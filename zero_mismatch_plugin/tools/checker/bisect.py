"""``zmrl bisect``: the first op whose output differs between vLLM's modules and the trainer's.

Both sides run the same teacher-forced input and report every op under the names of :mod:`.oplist`;
compared in execution order, the first op not bitwise equal (non-finite values fail) is named and
what follows is reported, not blamed. No engine is started: vLLM's model is built in this process
(:mod:`.engine_modules`). See docs/alignment-playbook.md.
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


def run_bisect(engine_modules, backend, batch, perturb=None) -> BisectResult:
    """Run both sides on ``batch`` and compare every op (``perturb`` goes to the trainer)."""
    engine_record: dict = {}
    engine_modules.forward(batch, engine_record)
    trainer_record = backend.intermediates(batch, perturb=perturb)
    result = compare_intermediates(engine_modules.op_names(), engine_record, trainer_record)
    result.tokens = batch.num_tokens
    result.target_tokens = int(batch.target_ids.numel())
    return result
