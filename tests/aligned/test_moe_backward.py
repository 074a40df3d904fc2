"""The routed experts' backward (aligned/moe_backward.py) against float64 autograd of the
forward it differentiates (``experts_with_lora``), with and without an adapter. Pure torch, no engine."""

import pytest
import torch

from zero_mismatch_plugin.aligned.moe import experts_with_lora
from zero_mismatch_plugin.aligned.moe_backward import experts_backward, experts_lora_backward, in_parameter_order

TOKENS, HIDDEN, WIDTH, EXPERTS, TOP_K, RANK, SCALING = 23, 16, 12, 5, 2, 4, 0.5
TARGETS = ("gate_proj", "up_proj", "down_proj")


def _problem(seed=0, unchosen=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    if unchosen is not None:  # no token picks this expert
        ids = torch.where(ids == unchosen, (unchosen + 1) % EXPERTS, ids)
        ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 2) % EXPERTS, ids[:, 1])
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    g = torch.randn(TOKENS, HIDDEN, generator=gen)
    gate, up = ([torch.randn(WIDTH, HIDDEN, generator=gen) * 0.3 for _ in range(EXPERTS)] for _ in range(2))
    down = [torch.randn(HIDDEN, WIDTH, generator=gen) * 0.3 for _ in range(EXPERTS)]
    shapes = {"gate_proj": (WIDTH, HIDDEN), "up_proj": (WIDTH, HIDDEN), "down_proj": (HIDDEN, WIDTH)}
    lora = {t: ([torch.randn(RANK, shapes[t][1], generator=gen) * 0.3 for _ in range(EXPERTS)],
                [torch.randn(shapes[t][0], RANK, generator=gen) * 0.3 for _ in range(EXPERTS)]) for t in TARGETS}
    return x, ids, weights, g, gate, up, down, lora


def _float64_reference(x, ids, weights, g, gate, up, down, lora):
    leaves = [x.double().requires_grad_(True), weights.double().requires_grad_(True)]
    lora64 = None if lora is None else {t: ([a.double().requires_grad_(True) for a in lora[t][0]],
                                            [b.double().requires_grad_(True) for b in lora[t][1]]) for t in TARGETS}
    params = [] if lora64 is None else [p for t in TARGETS for pair in zip(*lora64[t]) for p in pair]
    out = experts_with_lora(leaves[0], leaves[1], ids, *([w.double() for w in ws] for ws in (gate, up, down)),
                            lora64, SCALING)
    return torch.autograd.grad(out, leaves + params, g.double(), allow_unused=True)


def _relative(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


def test_the_lora_backward_matches_float64_autograd_of_the_forward():
    x, ids, weights, g, gate, up, down, lora = _problem()
    gx, gw, lora_grads = experts_lora_backward(x, g, ids, weights, gate, up, down, lora, SCALING)
    reference = _float64_reference(x, ids, weights, g, gate, up, down, lora)
    grads = [gx, gw, *in_parameter_order(lora_grads)]
    assert len(grads) == len(reference) == 2 + 6 * EXPERTS
    for name, actual, expected in zip(["x", "weights"] + [f"lora{i}" for i in range(6 * EXPERTS)], grads, reference):
        assert actual.shape == expected.shape, name
        assert _relative(actual, expected) < 1e-5, name


def test_an_expert_no_row_chose_gets_no_adapter_gradient():
    x, ids, weights, g, gate, up, down, lora = _problem(seed=1, unchosen=3)
    assert not (ids == 3).any()
    _, _, lora_grads = experts_lora_backward(x, g, ids, weights, gate, up, down, lora, SCALING)
    for target in TARGETS:
        assert lora_grads[target][0][3] is None and lora_grads[target][1][3] is None
        assert all(grad is not None for e, grad in enumerate(lora_grads[target][0]) if e != 3)


@pytest.mark.parametrize("scaling", [0.0, SCALING])
def test_without_adapter_the_input_gradients_are_the_base_backwards(scaling):
    """A zero B (a fresh adapter) or a zero scaling: the adapter changes nothing of d x and d weights."""
    x, ids, weights, g, gate, up, down, lora = _problem(seed=2)
    if scaling:
        lora = {t: (lora[t][0], [torch.zeros_like(b) for b in lora[t][1]]) for t in TARGETS}
    gx, gw, _ = experts_lora_backward(x, g, ids, weights, gate, up, down, lora, scaling)
    base_gx, base_gw, *_ = experts_backward(x, g, ids, weights, gate, up, down)
    assert torch.allclose(gx, base_gx, rtol=1e-5, atol=1e-6) and torch.allclose(gw, base_gw, rtol=1e-5, atol=1e-6)
    # Negative control: the adapter of _problem does change them.
    with_adapter, _, _ = experts_lora_backward(*_problem(seed=2)[:1], g, ids, weights, gate, up, down,
                                               _problem(seed=2)[-1], SCALING)
    assert not torch.allclose(with_adapter, base_gx, rtol=1e-3)


def _gate_up_by_expert(x, ids, gate, up, lora):
    """The forward's gate/up pre-activations with the adapter, rows sorted by expert (stable), as the
    CPU experts hand them over."""
    order = torch.argsort(ids.reshape(-1), stable=True)
    rows = []
    for row in order.tolist():
        v, e = x[row // TOP_K], int(ids.reshape(-1)[row])
        pre = [w[e] @ v + SCALING * (lora[t][1][e] @ (lora[t][0][e] @ v))
               for w, t in ((gate, "gate_proj"), (up, "up_proj"))]
        rows.append(torch.cat(pre))
    return torch.stack(rows)


def test_the_forwards_kept_gate_up_replaces_its_recomputation():
    x, ids, weights, g, gate, up, down, lora = _problem(seed=3)
    kept = _gate_up_by_expert(x, ids, gate, up, lora)
    with_kept = experts_lora_backward(x, g, ids, weights, gate, up, down, lora, SCALING, gate_up=kept)
    recomputed = experts_lora_backward(x, g, ids, weights, gate, up, down, lora, SCALING)
    reference = _float64_reference(x, ids, weights, g, gate, up, down, lora)
    flat = [with_kept[0], with_kept[1], *in_parameter_order(with_kept[2])]
    for actual, again, expected in zip(flat, [recomputed[0], recomputed[1], *in_parameter_order(recomputed[2])],
                                       reference):
        assert _relative(actual, expected) < 1e-5 and torch.allclose(actual, again, rtol=1e-4, atol=1e-6)
    # Rows in token order instead of by expert: a different (wrong) d x, which the check would see.
    shuffled = experts_lora_backward(x, g, ids, weights, gate, up, down, lora, SCALING, gate_up=kept.flip(0))
    assert _relative(shuffled[0], reference[0]) > 1e-2
    with pytest.raises(ValueError, match="routed rows"):
        experts_lora_backward(x, g, ids, weights, gate, up, down, lora, SCALING, gate_up=kept[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_backward_runs_in_the_dtype_of_its_input(dtype):
    """Without an adapter the backward computes in the activations' dtype: for a bf16 engine bf16
    GEMMs (fp32 accumulation) on bf16 copies of the fp32 master weights, as transformers' bf16
    autograd runs its experts; fp32 throughout for fp32. Against float64 within that precision."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, ids, weights, g, gate, up, down, _ = _problem(seed=4)
    x, g = x.to(dtype), g.to(dtype)
    gemms = (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm_.default,
             torch.ops.aten.bmm.default)

    class GemmDtypes(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in gemms:
                self.seen |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
            return func(*args, **(kwargs or {}))

    with GemmDtypes() as mode:
        gx, gw, ggate, gup, gdown = experts_backward(x, g, ids, weights, gate, up, down)
    assert mode.seen == {dtype}, mode.seen
    assert {t.dtype for t in (gx, gw, *ggate, *gup, *gdown)} == {dtype}
    leaves = [t.double().requires_grad_(True) for t in (x, weights, *gate, *up, *down)]
    x64, w64, experts64 = leaves[0], leaves[1], leaves[2:]
    out = experts_with_lora(x64, w64, ids, experts64[:EXPERTS], experts64[EXPERTS:2 * EXPERTS],
                            experts64[2 * EXPERTS:], None, SCALING)
    reference = torch.autograd.grad(out, leaves, g.double())
    names = ["x", "weights"] + [f"{part}{e}" for part in ("gate", "up", "down") for e in range(EXPERTS)]
    errors = {name: _relative(actual, expected)
              for name, actual, expected in zip(names, (gx, gw, *ggate, *gup, *gdown), reference)}
    print(f"{dtype} experts backward vs float64: worst {max(errors.values()):.3g} ({max(errors, key=errors.get)})")
    assert max(errors.values()) < (1e-5 if dtype == torch.float32 else 2e-2), errors
