"""Expert parallelism in the engine's arithmetic: the router alone, one rank's experts one
(token, slot) row at a time, and the combine of vLLM's CPU fused-MoE kernel.

vLLM's one-process MoE layer (``_C.cpu_fused_moe``) computes, per token, each chosen expert's
output ``y_k`` in fp32 (each row on its own: no split-K, threads split the output columns only),
then the weighted sum in slot order, ``out = y_0 w_0``, ``out = out + y_k w_k`` for k = 1..K-1.
Whether each step is rounded once (the compiler's fused multiply-add) or twice (a multiply, then
an add) is the build's: :func:`probe_combine_arithmetic` asks the kernel on this host. A trainer
whose experts live on several ranks sends each (token, slot) row to the rank holding its expert,
gets ``y_k`` back (:class:`AlignedExpertRows`: the kernel at top-1 with weight 1, exact), and sums
the slots as the kernel does (:func:`slot_order_combine`): the bits of the engine at one process.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd import Function

from zero_mismatch_plugin.aligned.derived import DerivedWeight
from zero_mismatch_plugin.aligned.moe import (EXPERT_SLICES, AlignedMoE, expert_lora_weights, routing_weights,
                                               stacked_expert_lora)
from zero_mismatch_plugin.aligned.moe_backward import experts_backward, experts_lora_backward, in_parameter_order
from zero_mismatch_plugin.aligned.ops import observable
from zero_mismatch_plugin.aligned.runtime import VllmRuntime
from zero_mismatch_plugin.tables.architectures import MoeBlocks

FUSED, SEPARATE = "fused multiply-add", "multiply then add"


def fused_multiply_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of fp32 tensors rounded once (IEEE fma, round to nearest even).

    The product of two fp32 values is exact in fp64, so the fp64 sum ``s`` is the exact result
    rounded once; rounding ``s`` to fp32 rounds twice, and that differs from one rounding only
    where ``s`` is exactly halfway between two fp32 values (a midpoint is an fp64 value, so the
    first rounding can reach it but not cross it). Those values, found from ``s``'s bits (and every
    value in fp32's subnormal range, where the bits say less), are settled by the exact sum's error
    (:func:`_settle_halfway`); the rest is ``s`` rounded.
    """
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    r = s.float()
    # fp32 keeps 23 of fp64's 52 fraction bits: a midpoint's 29 dropped bits are 1 then 28 zeros.
    halfway = (s.view(torch.int64) & 0x1FFFFFFF) == 0x10000000
    suspect = halfway | (s.abs() < 2.0**-126)
    if bool(suspect.any()):
        at = suspect.nonzero(as_tuple=True)
        r[at] = _settle_halfway(p[at], c64[at], s[at])
    return r


def _settle_halfway(p: torch.Tensor, c64: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 ``p + c64`` rounded once, from the fp64 sum ``s``: where ``s`` is halfway between two
    fp32 values, the sign of the sum's error ``e`` (Knuth's two-sum: ``s + e`` is exact) picks
    the neighbour; elsewhere ``s`` rounded."""
    virtual = s - p
    e = (p - (s - virtual)) + (c64 - virtual)
    r = s.float()
    below = torch.where(r.double() > s, torch.nextafter(r, r.new_tensor(float("-inf"))), r)
    above = torch.nextafter(below, below.new_tensor(float("inf")))
    halfway = (below.double() + above.double()) * 0.5 == s
    return torch.where(halfway & (e > 0), above, torch.where(halfway & (e < 0), below, r))


def slot_order_combine(slot_outputs: torch.Tensor, weights: torch.Tensor, arithmetic: str) -> torch.Tensor:
    """``out = y_0 w_0``, then ``out = out + y_k w_k`` for k = 1..K-1, in fp32 (vLLM's CPU fused-MoE
    weighted sum; ``arithmetic``: :data:`FUSED` or :data:`SEPARATE`, as :func:`probe_combine_arithmetic`
    found). ``slot_outputs`` [T, K, H], ``weights`` [T, K]. The gradient is that of ``sum_k y_k w_k``."""
    if arithmetic not in (FUSED, SEPARATE):
        raise ValueError(f"arithmetic must be {FUSED!r} or {SEPARATE!r}, not {arithmetic!r}")
    return _SlotOrderCombineFn.apply(slot_outputs, weights, arithmetic)


class _SlotOrderCombineFn(Function):
    @staticmethod
    def forward(ctx, slot_outputs, weights, arithmetic):
        y, w = slot_outputs.float(), weights.float().unsqueeze(-1)
        ctx.save_for_backward(y, w)
        out = y[:, 0] * w[:, 0]
        for k in range(1, y.shape[1]):
            out = fused_multiply_add(y[:, k], w[:, k], out) if arithmetic == FUSED else out + y[:, k] * w[:, k]
        return out

    @staticmethod
    def backward(ctx, g):
        y, w = ctx.saved_tensors
        g = g.float().unsqueeze(1)
        return g * w, (g * y).sum(-1), None


def local_experts(num_experts: int, ranks: int, rank: int) -> range:
    """The global ids of the experts rank ``rank`` of ``ranks`` holds (megatron's contiguous split)."""
    if num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not split over {ranks} expert-parallel ranks")
    per = num_experts // ranks
    return range(rank * per, (rank + 1) * per)


class EngineRouter:
    """vLLM's router of an MoE layer, alone: (top-k weights [T, K] fp32, expert ids [T, K]) from the
    router logits, the weights differentiable (the backward of :func:`.moe.routing_weights`)."""

    def __init__(self, runtime: VllmRuntime, moe: MoeBlocks, correction_bias: torch.Tensor | None = None):
        from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router

        self.runtime, self.moe = runtime, moe
        self._engine_bias = None
        if moe.e_score_correction_bias:
            if correction_bias is None:
                raise ValueError("this MoE routing needs its e_score_correction_bias")
            self._engine_bias = torch.zeros(moe.num_experts, dtype=torch.float32, device=runtime.device)
        with runtime.context():
            self.router = create_fused_moe_router(
                top_k=moe.top_k, global_num_experts=moe.num_experts, renormalize=moe.norm_topk_prob,
                use_grouped_topk=moe.grouped_topk, num_expert_group=moe.n_group, topk_group=moe.topk_group,
                scoring_func=moe.scoring_func,
                # As AlignedMoE's runner: grouped routing scales the output, not the weights.
                routed_scaling_factor=1.0 if moe.grouped_topk else moe.routed_scaling_factor,
                e_score_correction_bias=self._engine_bias,
            )
        # The weights route() returns, as a function of the logits (for their backward): grouped
        # routing's scaling factor is the output's (output_scale), not the weights'.
        self.weights_of = dataclasses.replace(moe, routed_scaling_factor=1.0) if moe.grouped_topk else moe
        self.derived = DerivedWeight([correction_bias], self._copy_bias)

    def _copy_bias(self, sources):
        if self._engine_bias is not None:
            self._engine_bias.copy_(sources[0].float())
        return self.router

    def route(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm.forward_context import set_forward_context

        router = self.derived.get()
        logits32 = logits.float() if self.moe.grouped_topk else logits
        with torch.no_grad(), self.runtime.context(), set_forward_context(
            None, self.runtime.vllm_config, num_tokens=hidden.shape[0]
        ):
            weights, ids = router.select_experts(hidden_states=hidden.detach().clone(),
                                                 router_logits=logits32.detach().clone(),
                                                 topk_indices_dtype=torch.int32)
        return _RoutingWeightsFn.apply(logits, weights.float(), ids, self.weights_of), ids.long()

    def output_scale(self) -> float:
        """What the engine's runner multiplies the combined routed output by (grouped routing)."""
        return self.moe.routed_scaling_factor if self.moe.grouped_topk else 1.0


class _RoutingWeightsFn(Function):
    @staticmethod
    def forward(ctx, logits, weights, ids, moe):
        ctx.save_for_backward(logits, ids)
        ctx.moe = moe
        return weights

    @staticmethod
    def backward(ctx, g):
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().float().requires_grad_(True)
            (glogits,) = torch.autograd.grad(routing_weights(x, ids, ctx.moe), x, g)
        return glogits.to(logits.dtype), None, None, None


def _one_expert_per_row(moe: MoeBlocks, num_local: int) -> MoeBlocks:
    return dataclasses.replace(moe, num_experts=num_local, top_k=1, norm_topk_prob=False, scoring_func="softmax",
                               grouped_topk=False, n_group=None, topk_group=None, e_score_correction_bias=False,
                               routed_scaling_factor=1.0)


@dataclasses.dataclass(frozen=True)
class EngineShard:
    """Tensor-parallel engine rank ``rank`` of ``ranks``'s share of an expert of width
    ``full_width``, as vLLM splits an expert over its ranks: columns ``rank`` of the gate and the up
    projection and the same columns of the down projection's input; of an adapter on the expert
    (vLLM's ``FusedMoEWithLoRA``), the gate's and up's B rows and the down's A columns, the other
    matrices whole. Slicing is the identity at one rank; a gradient of a slice is the whole
    matrix's, zero outside it."""

    rank: int = 0
    ranks: int = 1
    full_width: int = 0

    @classmethod
    def of(cls, full_width: int, engine_shard: tuple[int, int]) -> EngineShard:
        """``engine_shard`` = (rank, ranks) of an expert of width ``full_width``."""
        rank, ranks = engine_shard
        if full_width % ranks:
            raise ValueError(f"the expert width {full_width} does not split over {ranks} engine ranks")
        return cls(rank, ranks, full_width)

    @property
    def columns(self) -> slice:
        width = self.full_width // self.ranks
        return slice(self.rank * width, (self.rank + 1) * width)

    def gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up[: self.full_width][self.columns]

    def up(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up[self.full_width :][self.columns]

    def gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up if self.ranks == 1 else torch.cat([self.gate(gate_up), self.up(gate_up)])

    def down(self, down: torch.Tensor) -> torch.Tensor:
        return down[:, self.columns]

    def lora(self, params: list, num_experts: int) -> list:
        """The shard's part of each adapter matrix, listed as the expert-LoRA ops list them
        (target by target, expert by expert, A before B)."""
        return [p[self._lora_index(i, num_experts)] for i, p in enumerate(params)]

    def whole_gate_up_grad(self, like: torch.Tensor, ggate: torch.Tensor, gup: torch.Tensor) -> torch.Tensor:
        grad = like.new_zeros(like.shape)
        self.gate(grad).copy_(ggate)
        self.up(grad).copy_(gup)
        return grad

    def whole_down_grad(self, like: torch.Tensor, gdown: torch.Tensor) -> torch.Tensor:
        grad = like.new_zeros(like.shape)
        self.down(grad).copy_(gdown)
        return grad

    def whole_lora_grads(self, params: list, grads: list, num_experts: int) -> list:
        """The gradients of the whole adapter matrices ``params`` from those of :meth:`lora`'s slices."""
        if self.ranks == 1:
            return grads
        out = []
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                out.append(None)
                continue
            whole = p.new_zeros(p.shape, dtype=g.dtype)
            whole[self._lora_index(i, num_experts)] = g
            out.append(whole)
        return out

    def _lora_index(self, position: int, num_experts: int):
        target = EXPERT_SLICES[position // (2 * num_experts)]
        is_b = position % 2 == 1
        if target == "down_proj":
            return (slice(None), slice(None)) if is_b else (slice(None), self.columns)
        return (self.columns, slice(None)) if is_b else (slice(None), slice(None))


class AlignedExpertRows(AlignedMoE):
    """vLLM's fused experts over one rank's experts (``gate_up`` [2I, H], ``down`` [H, I] each),
    every row through the one expert ``local_ids`` names with weight 1: the per-slot expert output
    the engine's kernel weights and sums (exact: ``y * 1``). Backward: fp32 torch.

    ``engine_shard`` = (rank, ranks): the output of tensor-parallel engine rank ``rank`` of
    ``ranks``, which holds columns ``rank`` of each expert's gate and up and the same columns of
    its down projection (vLLM's split); the gradients are those of the whole weights (zero outside
    the shard)."""

    def __init__(self, runtime: VllmRuntime, moe: MoeBlocks, hidden_size: int, gate_up: list, down: list,
                 engine_shard: tuple[int, int] = (0, 1)):
        if runtime.vllm_config.lora_config is not None:
            raise NotImplementedError("expert parallelism with LoRA on the experts")
        self.shard = EngineShard.of(moe.moe_intermediate_size, engine_shard)
        shard = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size // self.shard.ranks)
        # Rows computed on a shard are that engine rank's, whatever the engine's tensor parallelism.
        super().__init__(runtime, _one_expert_per_row(shard, len(down)), hidden_size, None, None, down, gate_up=gate_up,
                         engine_rank_shard=True)

    def expert_weights(self, sources: list) -> tuple[list, list, list]:
        n, shard = self.moe.num_experts, self.shard
        fused, down = sources[:n], sources[n : 2 * n]
        return [shard.gate(w) for w in fused], [shard.up(w) for w in fused], [shard.down(w) for w in down]

    def param_grads(self, ggate: list, gup: list, gdown: list) -> list:
        if self.shard.ranks == 1:
            return super().param_grads(ggate, gup, gdown)
        return ([self.shard.whole_gate_up_grad(p, a, b) for p, a, b in zip(self.gate_up, ggate, gup)]
                + [self.shard.whole_down_grad(p, d) for p, d in zip(self.down, gdown)])

    def rows(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import set_forward_context

        runner = self.derived.get()
        if x.shape[0] == 0:
            return x.new_zeros(0, self.down[0].shape[0])
        with torch.no_grad(), self.runtime.context(), set_forward_context(
            None, self.runtime.vllm_config, num_tokens=x.shape[0]
        ):
            return runner.routed_experts.forward_modular(
                x=x.detach().clone(), topk_weights=torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device),
                topk_ids=local_ids.to(torch.int32).view(-1, 1).clone(), shared_experts=None, shared_experts_input=None)

    def __call__(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return _ExpertRowsFn.apply(x, local_ids, self, *self.params)


class AlignedExpertRowsLoRA:
    """One rank's experts over dispatched (token, slot) rows as an engine serving LoRA computes
    them: vLLM's CPU experts that take LoRA updates (:func:`..cpu_lora_experts.cpu_moe_experts`,
    each row on its own), every row through expert ``ids[i]`` at routing weight ``probs[i]``, the
    adapter's updates (``adapters[e]``: {gate_proj, up_proj, down_proj: LoRAPair}, or None for the
    experts alone) added as the engine adds them. Each row is the engine's slot value: the weight
    applied to the base output and to the update each before the slots are summed
    (:func:`slot_order_sum`). The base weights are frozen; the backward (fp32 torch,
    :func:`..moe_backward.experts_lora_backward`) reaches the rows, their weights and A and B.

    ``engine_shard`` = (rank, ranks): the rows of tensor-parallel engine rank ``rank`` of ``ranks``
    (:class:`EngineShard`: its columns of each expert and its slices of each adapter, as vLLM's
    ``FusedMoEWithLoRA`` splits them); the gradients are those of the whole matrices.

    What it packs is derived once and kept (:class:`..derived.DerivedWeight`): each expert's packed
    base linear until that weight's data changes (a reload), the adapter's stacked A and B (and
    with them their packed linears) until any of them does (an optimizer step); after writes
    through ``param.data``, :meth:`refresh`."""

    def __init__(self, runtime: VllmRuntime, gate_up: list, down: list, adapters: list | None = None,
                 lora_config=None, engine_shard: tuple[int, int] = (0, 1)):
        lora = runtime.vllm_config.lora_config
        if lora is None:
            raise ValueError("the trainer's engine arguments need enable_lora=True (as the engine's)")
        if adapters is not None and lora_config.r > lora.max_lora_rank:
            raise ValueError(f"adapter rank {lora_config.r} > max_lora_rank {lora.max_lora_rank}: raise max_lora_rank")
        if any(w.requires_grad for w in (*gate_up, *down)):
            raise NotImplementedError("experts of an engine serving LoRA train their adapters only: freeze the base "
                                      "expert weights (megatron.lora.attach_lora does)")
        self.runtime, self.gate_up, self.down, self.adapters = runtime, list(gate_up), list(down), adapters
        self.shard = EngineShard.of(self.gate_up[0].shape[0] // 2, engine_shard)
        self.scaling = lora_config.scaling if adapters is not None else 1.0
        self.max_rank, self.lora_dtype = lora.max_lora_rank, lora.lora_dtype
        self.lora_params = [] if adapters is None else [
            t for target in EXPERT_SLICES for e in adapters for t in (e[target].lora_A, e[target].lora_B)]
        from zero_mismatch_plugin.aligned.cpu_lora_experts import packed_cpu_linear

        shard = self.shard
        parts = ((self.gate_up, shard.gate_up), (self.down, shard.down))
        self.linears = [[DerivedWeight([w], lambda ws, part=part: packed_cpu_linear(part(ws[0]).contiguous()))
                         for w in weights] for weights, part in parts]
        self.stacked_lora = None if adapters is None else DerivedWeight(
            self.lora_params, lambda params: stacked_expert_lora(
                expert_lora_weights(shard.lora(params, len(adapters)), len(adapters)), self.max_rank, self.lora_dtype,
                self.scaling, params[0].device))

    def refresh(self) -> None:
        """Derive the packed linears and the stacked adapter again (after writes through ``param.data``)."""
        for derived in (*self.linears[0], *self.linears[1], *([self.stacked_lora] if self.stacked_lora else [])):
            derived.refresh()

    def rows(self, x: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from zero_mismatch_plugin.aligned.cpu_lora_experts import add_moe_lora, cpu_moe_experts

        ids2d, weights2d = ids.long().view(-1, 1), probs.float().view(-1, 1)
        linears = tuple([derived.get() for derived in weights] for weights in self.linears)
        # With the packed linears given, the experts read only the two weights' shapes: one expert's shard.
        w13, w2 = self.shard.gate_up(self.gate_up[0].detach())[None], self.shard.down(self.down[0].detach())[None]
        add_w13 = add_w2 = None
        if self.adapters is not None:
            a13, b13, a2, b2 = self.stacked_lora.get()
            # The experts hand over the rows sorted by expert, each a token of top-k 1, all in slot 0.
            def add_w13(y, x, ids, weights, order):
                add_moe_lora(y, x, ids, torch.zeros_like(order), a13, b13)

            def add_w2(y, x, ids, weights, order):
                add_moe_lora(y, x, ids, torch.zeros_like(order), a2, b2, weights)

        return cpu_moe_experts(x, w13, w2, weights2d, ids2d, add_w13, add_w2, linears=linears)

    def __call__(self, x: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _ExpertRowsLoRAFn.apply(x, probs, ids, self, *self.lora_params)


class _ExpertRowsLoRAFn(Function):
    @staticmethod
    def forward(ctx, x, probs, ids, op: AlignedExpertRowsLoRA, *lora_params):
        with torch.no_grad():
            out = op.rows(x, probs, ids)
        ctx.save_for_backward(x, probs, ids, *lora_params)
        ctx.op = op
        return out

    @staticmethod
    def backward(ctx, g):
        x, probs, ids, *lora_params = ctx.saved_tensors
        op, shard = ctx.op, ctx.op.shard
        gate = [shard.gate(w.detach()) for w in op.gate_up]
        up = [shard.up(w.detach()) for w in op.gate_up]
        down = [shard.down(w.detach()) for w in op.down]
        rows = (x, g, ids.long().view(-1, 1), probs.detach().view(-1, 1), gate, up, down)
        if op.adapters is None:
            gx, gw, *_ = experts_backward(*rows)
            gparams = []
        else:
            n = len(op.adapters)
            gx, gw, lora_grads = experts_lora_backward(
                *rows, expert_lora_weights(shard.lora(list(lora_params), n), n), op.scaling)
            gparams = shard.whole_lora_grads(list(lora_params), in_parameter_order(lora_grads), n)
        gw = gw.view_as(probs).to(probs.dtype)
        return (gx.to(x.dtype), gw, None, None,
                *(None if gp is None else gp.to(p.dtype) for gp, p in zip(gparams, lora_params)))


class EngineRankRoutedOutput:
    """At tensor x expert parallelism, what tensor-parallel engine rank ``r``'s routed experts
    output for every token (its shard of each expert, the slots summed; before the engine's
    all-reduce), as the op vLLM's MoE layer is on that rank: each trainer rank holds every shard's
    output for its own tokens (sequence parallelism), and trainer rank ``r`` gathers shard ``r``'s
    parts in token order. A collective that only inspection needs (``zmrl bisect``): the face
    calls it while an observer records (:func:`..ops.observing`), every rank of ``group`` at once."""

    recorded_as = "moe"

    def __init__(self, group, last_topk_ids: torch.Tensor):
        self.group, self.last_topk_ids = group, last_topk_ids

    @observable
    def __call__(self, per_shard: list) -> torch.Tensor:
        from zero_mismatch_plugin.aligned.reductions import all_gather_parts

        rank = torch.distributed.get_rank(self.group)
        every = all_gather_parts(torch.stack([part.detach() for part in per_shard]), self.group)
        return torch.cat([shards[rank] for shards in every])


def slot_order_sum(slot_rows: torch.Tensor) -> torch.Tensor:
    """``[T, K, H]`` slot values summed per token in slot order, ``s_0 + s_1 + ...`` in fp32 (how
    vLLM's CPU LoRA experts sum a token's weighted slots)."""
    out = slot_rows[:, 0]
    for k in range(1, slot_rows.shape[1]):
        out = out + slot_rows[:, k]
    return out


class ExpertParallelExperts:
    """A layer's routed experts at expert parallelism as one op of the op layer, as vLLM's fused-MoE
    layer is one op: ``route(x, router_logits)`` (the router, the dispatch to the experts' ranks,
    the combine) gives the routed output [T, H], and ``topk_ids()`` the experts it chose. What the
    bisect recorder sees as the layer's ``experts`` (the rows of one rank's experts, dispatched,
    are not the engine's)."""

    recorded_as = "moe"

    def __init__(self, route, topk_ids):
        self.route, self.topk_ids = route, topk_ids

    @observable
    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.route(x, router_logits)

    @property
    def last_topk_ids(self):
        return self.topk_ids()


class _ExpertRowsFn(Function):
    @staticmethod
    def forward(ctx, x, local_ids, op: AlignedExpertRows, *params):
        ctx.save_for_backward(x, local_ids)
        ctx.op = op
        return op.rows(x, local_ids)

    @staticmethod
    def backward(ctx, g):
        x, local_ids = ctx.saved_tensors
        op = ctx.op
        ids = local_ids.long().view(-1, 1)
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        gx, _, ggate, gup, gdown = experts_backward(x, g, ids, ones, *op.expert_weights(op.params))
        return (gx.to(x.dtype), None, None, *op.param_grads(ggate, gup, gdown))


# (platform, dtype, routing) -> the arithmetic found there
_FOUND: dict = {}


def probe_combine_arithmetic(runtime: VllmRuntime, moe: MoeBlocks, hidden_size: int, seed: int = 0) -> str:
    """How this host's vLLM CPU fused-MoE kernel rounds its weighted sum: :data:`FUSED` or
    :data:`SEPARATE`, found by running the kernel at top-K on random experts and comparing it with
    both sums of its own top-1 outputs; an error if it is neither (no expert-parallel layout is then
    bitwise on this host). Once per (platform, dtype, routing)."""
    key = (runtime.platform, str(runtime.dtype), moe)
    if key not in _FOUND:
        _FOUND[key] = _measure_combine(runtime, moe, hidden_size, seed)
    return _FOUND[key]


def _measure_combine(runtime, moe, hidden_size, seed) -> str:
    g = torch.Generator().manual_seed(seed)
    width, experts = moe.moe_intermediate_size, moe.num_experts
    gate_up = [torch.randn(2 * width, hidden_size, generator=g) * 0.05 for _ in range(experts)]
    down = [torch.randn(hidden_size, width, generator=g) * 0.05 for _ in range(experts)]
    bias = torch.randn(experts, generator=g) * 0.05 if moe.e_score_correction_bias else None
    # At tensor parallelism > 1 the probe runs the kernel in the trainer's process all the same.
    tensor_parallel = runtime.vllm_config.parallel_config.tensor_parallel_size > 1
    full = AlignedMoE(runtime, moe, hidden_size, None, None, down, bias, gate_up=gate_up,
                      engine_rank_shard=tensor_parallel)
    x = torch.randn(64, hidden_size, generator=g)
    logits = torch.randn(64, experts, generator=g)
    engine_out, _ = full.kernel(x, logits)
    router = EngineRouter(runtime, moe, bias)
    with torch.no_grad():
        weights, ids = router.route(x, logits)
        rows = AlignedExpertRows(runtime, moe, hidden_size, gate_up, down)
        y = rows.rows(x.repeat_interleave(moe.top_k, 0), ids.reshape(-1)).view(x.shape[0], moe.top_k, -1)
        found = {}
        for arithmetic in (FUSED, SEPARATE):
            out = slot_order_combine(y, weights, arithmetic) * router.output_scale()
            found[arithmetic] = torch.equal(out.to(engine_out.dtype), engine_out)
    return combine_verdict(found)


def combine_verdict(found: dict[str, bool]) -> str:
    """The one arithmetic that reproduced the kernel, or a loud refusal."""
    matching = [name for name, equal in found.items() if equal]
    if len(matching) == 1:
        return matching[0]
    if not matching:
        raise NotImplementedError(
            "vLLM's CPU fused-MoE combine on this host is neither a fused multiply-add nor a multiply "
            "then an add per slot: expert parallelism cannot reproduce it; use expert_model_parallel_size=1")
    # Both reproduced it: the probe's data did not tell them apart (no rounding step differed).
    raise RuntimeError("the combine probe could not tell fused from separate rounding; probe with another seed")
