"""A difference planted in one trainer op, and what ``zmrl bisect`` must then report."""

from __future__ import annotations

import torch


def assert_bisect_names_one_ulp_planted_in(planted: str, engine_modules, backend, batch):
    """Move the first value of the trainer's op ``planted`` one ulp (of its dtype); bisect must name exactly
    that op, with that one value differing and every op before it equal. Returns the result."""
    from zero_mismatch_plugin.tools.checker.bisect import run_bisect

    moved = {}

    def one_ulp(name, value):
        if name != planted:
            return value
        out = value.clone()
        flat = out.view(-1)
        if flat.dtype in (torch.bfloat16, torch.float16):  # the next 16-bit pattern: one ulp of that format
            flat[:1] = (flat[:1].view(torch.int16) + 1).view(flat.dtype)
        else:
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
        moved["ulp"] = float((flat[0] - value.reshape(-1)[0]).abs())
        return out

    result = run_bisect(engine_modules, backend, batch, perturb=one_ulp)
    print(f"planted in {planted}: first differing op {result.first_differing_op}")
    assert "ulp" in moved, f"the trainer ran no op named {planted}"
    first = result.first
    assert result.first_differing_op == planted
    assert first.max_abs_diff == moved["ulp"] > 0.0
    assert first.num_differing == 1  # exactly the one value moved
    assert first.equal_fraction == (first.numel - 1) / first.numel
    names = [op.name for op in result.ops]
    assert all(op.equal for op in result.ops[: names.index(planted)])
    return result
