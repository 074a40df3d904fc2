"""``zmrl bisect``: the first op whose output differs between vLLM's modules and the trainer's.

Both sides get the same packed input (prompts plus fixed pseudo-random response tokens, teacher
forced) and report every intermediate output under the names of :mod:`.oplist`. They are
compared in execution order; the first op whose output is not bitwise equal is where the two
computations part. A NaN or an infinity in an op's output, on either side, fails that op: it is
reported as non-finite values, never as equal. Everything after it differs too, as a consequence, so it is reported, not
blamed. An op only one side exposes is listed as not compared.

No engine is started: the engine side is vLLM's model built in this process (see
:mod:`.engine_modules`), which computes what the engine's forward computes for the same
teacher-forced input. Decode-time effects (batch composition, prefill vs decode, prefix cache)
are what ``zmrl check`` measures.
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
