"""The backward of the routed experts, with and without a LoRA adapter on each expert.

Without an adapter it runs in the dtype of the experts' input: fp32 for an fp32 engine, and for a
bf16 engine bf16 GEMMs (fp32 accumulation) and SwiGLU products, what transformers' bf16 autograd
computes for its experts (as the dense layers' backward does, :mod:`.ops`). With an adapter: fp32.

vLLM's experts keep none of their intermediates, so the gate and up products are recomputed here;
the (token, slot) rows are sorted by expert once (one gather of x and g), so each expert's rows are
one contiguous block: its matmuls write into row blocks of shared buffers and every elementwise step
runs once over all rows. The forward these differentiate is :func:`..moe.experts_with_lora`
(``lora`` None: the experts alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _RowsByExpert:
    """The routed rows of ``ids`` [T, K] grouped by expert: ``order`` (stable), each expert's
    ``blocks`` of the sorted rows and their ``counts``; ``xs``, ``gs``, ``ws``: x, g and the
    routing weight of each sorted row (in ``dtype``)."""

    tokens: int
    top_k: int
    order: torch.Tensor
    counts: list
    blocks: list
    xs: torch.Tensor
    gs: torch.Tensor
    ws: torch.Tensor

    @classmethod
    def of(cls, x, g, ids, weights, num_experts: int, dtype=torch.float32) -> "_RowsByExpert":
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        rows_token = order // k
        blocks, start = [], 0
        for n in counts:
            blocks.append(slice(start, start + n))
            start += n
        return cls(ids.shape[0], k, order, counts, blocks, x.to(dtype).index_select(0, rows_token),
                   g.to(dtype).index_select(0, rows_token),
                   weights.reshape(-1).to(dtype).index_select(0, order).unsqueeze(-1))

    def to_token_slots(self, gx_rows, gw_rows):
        """(d x [T, H], d weights [T, K]) from the sorted rows' gradients: each row written back
        once, then summed over the slots (a scatter-add into the tokens would serialise on a CPU)."""
        gx_slots = torch.empty_like(gx_rows).index_copy_(0, self.order, gx_rows)
        gweights = torch.empty_like(gw_rows).index_copy_(0, self.order, gw_rows).view(self.tokens, self.top_k)
        return gx_slots.view(self.tokens, self.top_k, gx_rows.shape[-1]).sum(1), gweights


def _swiglu_backward(a, b, gh, ws):
    """(d a, d b, h * w, d weights) of ``w * (silu(a) * b)`` against ``gh`` (d out / d h before the
    routing weight ``ws``); d weights = gh . h. ``gh`` is overwritten."""
    silu_a = torch.nn.functional.silu(a)
    h = silu_a * b
    gw_rows = torch.einsum("ni,ni->n", gh, h)
    h.mul_(ws)  # h * weight: what the down projection's weight gradients multiply
    gh.mul_(ws)
    gb = silu_a.mul_(gh)
    ga = torch.ops.aten.silu_backward(gh.mul_(b), a)
    return ga, gb, h, gw_rows


def experts_backward(x, g, ids, weights, gate, up, down):
    """Gradients of out[t] = sum_k weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t),
    e = ids[t, k]: returns (d x, d weights, [d gate_e], [d up_e], [d down_e]), computed in the
    dtype of ``x`` (fp32, or bf16 with fp32 accumulation for a bf16 engine's activations).

    The down product is not recomputed: d weights[t, k] = (g_t down_e) . h_t comes from the d h
    product the backward needs anyway.
    """
    dtype = x.dtype
    rows = _RowsByExpert.of(x, g, ids, weights, len(gate), dtype)
    xs, gs = rows.xs, rows.gs
    width = gate[0].shape[0]
    weights_of = [(gate[e].detach().to(dtype), up[e].detach().to(dtype), down[e].detach().to(dtype))
                  for e in range(len(gate))]

    a, b, gh = (xs.new_empty(xs.shape[0], width) for _ in range(3))
    for (wg, wu, wd), block, n in zip(weights_of, rows.blocks, rows.counts):
        if n:
            torch.mm(xs[block], wg.t(), out=a[block])
            torch.mm(xs[block], wu.t(), out=b[block])
            torch.mm(gs[block], wd, out=gh[block])  # d out / d h before the routing weight
    ga, gb, h, gw_rows = _swiglu_backward(a, b, gh, rows.ws)

    gx_rows = torch.empty_like(xs)
    ggate, gup, gdown = [], [], []
    for (wg, wu, wd), block, n in zip(weights_of, rows.blocks, rows.counts):
        if n == 0:
            ggate.append(torch.zeros_like(wg))
            gup.append(torch.zeros_like(wu))
            gdown.append(torch.zeros_like(wd))
            continue
        xe = xs[block]
        gdown.append(gs[block].t() @ h[block])
        ggate.append(ga[block].t() @ xe)
        gup.append(gb[block].t() @ xe)
        torch.mm(ga[block], wg, out=gx_rows[block]).addmm_(gb[block], wu)
    gx, gweights = rows.to_token_slots(gx_rows, gw_rows)
    return gx, gweights, ggate, gup, gdown


def experts_lora_backward(x, g, ids, weights, gate, up, down, lora, scaling, gate_up=None):
    """fp32 gradients of the routed experts with an adapter on each expert's gate, up and down, the
    base weights frozen: each linear is ``W v + scaling * B (A v)`` (``lora``: {target: ([A_e],
    [B_e])}, as :func:`..moe.experts_with_lora`). Returns (d x, d weights, {target: ([d A_e],
    [d B_e])}), None for the A and B of an expert no row chose.

    For a linear ``y = W v + s B (A v)`` with output gradient ``gy``: ``d v = gy W + s (gy B) A``,
    ``d B = s gy^T (v A^T)``, ``d A = s (gy B)^T v`` (rows summed over the expert's block).
    ``gate_up``: the forward's gate/up pre-activations [T * K, 2I], rows sorted by expert (stable),
    taken instead of recomputed where the forward kept them.
    """
    rows = _RowsByExpert.of(x, g, ids, weights, len(gate))
    xs, gs = rows.xs, rows.gs
    width = gate[0].shape[0]
    f32 = [[t.detach().float() for t in group] for group in (gate, up, down)]
    pairs = {target: ([t.detach().float() for t in lora[target][0]], [t.detach().float() for t in lora[target][1]])
             for target in ("gate_proj", "up_proj", "down_proj")}
    (ag, bg), (au, bu), (ad, bd) = pairs["gate_proj"], pairs["up_proj"], pairs["down_proj"]
    rank = ag[0].shape[0]

    if gate_up is not None and tuple(gate_up.shape) != (xs.shape[0], 2 * width):
        raise ValueError(f"gate_up {tuple(gate_up.shape)}: expected the {xs.shape[0]} routed rows x {2 * width}")
    a, b = (gate_up[:, :width], gate_up[:, width:]) if gate_up is not None else (
        xs.new_empty(xs.shape[0], width), xs.new_empty(xs.shape[0], width))
    gh = xs.new_empty(xs.shape[0], width)
    xag, xau, gbd = (xs.new_empty(xs.shape[0], rank) for _ in range(3))
    for e, (block, n) in enumerate(zip(rows.blocks, rows.counts)):
        if n:
            xe, ge = xs[block], gs[block]
            torch.mm(xe, ag[e].t(), out=xag[block])
            torch.mm(xe, au[e].t(), out=xau[block])
            if gate_up is None:
                torch.mm(xe, f32[0][e].t(), out=a[block]).addmm_(xag[block], bg[e].t(), alpha=scaling)
                torch.mm(xe, f32[1][e].t(), out=b[block]).addmm_(xau[block], bu[e].t(), alpha=scaling)
            # d out / d h before the routing weight: g (W_d + s B_d A_d)
            torch.mm(ge, f32[2][e], out=gh[block]).addmm_(torch.mm(ge, bd[e], out=gbd[block]), ad[e], alpha=scaling)
    ga, gb, h, gw_rows = _swiglu_backward(a, b, gh, rows.ws)

    gx_rows = torch.empty_like(xs)
    grads = {target: ([None] * len(gate), [None] * len(gate)) for target in pairs}
    for e, (block, n) in enumerate(zip(rows.blocks, rows.counts)):
        if n == 0:
            continue
        xe, ge, he, gae, gbe = xs[block], gs[block], h[block], ga[block], gb[block]
        ga_b, gb_b = gae @ bg[e], gbe @ bu[e]
        for target, a_grad, b_grad in (
            ("gate_proj", ga_b.t() @ xe, gae.t() @ xag[block]),
            ("up_proj", gb_b.t() @ xe, gbe.t() @ xau[block]),
            ("down_proj", gbd[block].t() @ he, ge.t() @ (he @ ad[e].t())),
        ):
            grads[target][0][e], grads[target][1][e] = a_grad.mul_(scaling), b_grad.mul_(scaling)
        (torch.mm(gae, f32[0][e], out=gx_rows[block]).addmm_(gbe, f32[1][e])
         .addmm_(ga_b, ag[e], alpha=scaling).addmm_(gb_b, au[e], alpha=scaling))
    gx, gweights = rows.to_token_slots(gx_rows, gw_rows)
    return gx, gweights, grads


def in_parameter_order(lora_grads: dict) -> list:
    """The A and B gradients of :func:`experts_lora_backward` listed target by target (gate, up,
    down), expert by expert, A before B: the order the expert-LoRA ops list their parameters in."""
    return [grad for target in ("gate_proj", "up_proj", "down_proj")
            for pair in zip(*lora_grads[target]) for grad in pair]
