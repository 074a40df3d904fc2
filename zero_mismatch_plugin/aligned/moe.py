"""The Mixture-of-Experts op: vLLM's router and fused-experts layer forward, torch backward.

The forward is vLLM's own MoE layer (``FusedMoEFactory`` -> ``MoERunner``: the router of the
platform, ``CPURouter`` on CPU, then the routed experts' kernel, ``CPUUnquantizedExperts`` ->
``_C.cpu_fused_moe`` on CPU) built under the engine's ``VllmConfig`` and fed the trainer's expert
weights through the layer's own weight loader and post-load processing (intermediate padding,
pre-packing). Its numerics (an approximate exp in SiLU, the top-k combine in slot order, the
padded intermediate size) are therefore the engine's, and are not repeated here.

The backward is plain fp32 torch: the experts (gate, up, down), and the router logits through the
top-k weights; the selection itself (which experts) is piecewise constant and has no gradient.
The router's gate linear and any shared expert are composed from the dense ops of :mod:`.ops`.
"""

from __future__ import annotations

import itertools

import torch
from torch.autograd import Function

from .derived import DerivedWeight
from .ops import _observable
from .runtime import VllmRuntime
from ..architectures import MoeBlocks
from ..patching.shared import row_invariant_sigmoid
# Shared with verl's rollout weight reload (the verl fork patch carries its source): re-exported here.
from ..patching.shared import reprocess_moe_as_first_load  # noqa: F401

_layer_ids = itertools.count()


def refuse_unsupported_engine(runtime: VllmRuntime) -> None:
    """Engine settings under which vLLM's MoE layer would not be this one-process layer."""
    cfg = runtime.vllm_config
    par = cfg.parallel_config
    problems = []
    if par.tensor_parallel_size != 1:
        problems.append(f"tensor_parallel_size={par.tensor_parallel_size}: use 1")
    if par.data_parallel_size != 1:
        problems.append(f"data_parallel_size={par.data_parallel_size}: use 1")
    if par.enable_expert_parallel:
        problems.append("enable_expert_parallel (expert parallelism): leave it off")
    if par.enable_eplb:
        problems.append("enable_eplb (redundant experts): leave it off")
    if cfg.model_config.quantization is not None:
        problems.append(f"quantization={cfg.model_config.quantization!r}: use unquantized experts")
    if cfg.lora_config is not None:
        problems.append("enable_lora (vLLM has no CPU path for LoRA on experts): leave it off")
    if problems:
        raise NotImplementedError(
            "the aligned Mixture-of-Experts forward runs vLLM's one-process MoE layer; not with "
            + "; ".join(problems)
        )


def routing_weights(logits: torch.Tensor, ids: torch.Tensor, moe: MoeBlocks) -> torch.Tensor:
    """The top-k weights [T, K] of the experts ``ids`` [T, K] chosen from ``logits`` [T, E], as a
    differentiable function of the logits (vLLM's CPU router's arithmetic, in torch).

    Softmax routing: the softmax over the chosen logits when renormalized, else the chosen entries
    of the full softmax. Sigmoid (DeepSeek-V3 / GLM-4.5) routing: the chosen sigmoid scores (the
    correction bias steers the choice only), renormalized if asked, times routed_scaling_factor;
    the sigmoid is the row-count-invariant one the engine's router runs in consistent mode.
    """
    logits = logits.float()
    ids = ids.long()
    if moe.scoring_func == "softmax" and not moe.grouped_topk:
        chosen = logits.gather(1, ids)
        if moe.norm_topk_prob:
            return torch.softmax(chosen, dim=-1)
        return (chosen - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    scores = row_invariant_sigmoid(logits) if moe.scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    w = scores.gather(1, ids)
    if moe.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * moe.routed_scaling_factor


def moe_mlp(hidden: torch.Tensor, router, experts, shared=None) -> torch.Tensor:
    """An MoE block in vLLM's composition, on ``hidden`` [T, H]: the routed experts
    ``experts(hidden, router(hidden))`` plus, where ``shared`` = (gate_up, act, down, gate or
    None), the shared expert ``down(act(gate_up(hidden)))``, scaled by ``sigmoid(gate(hidden))``
    where it has a gate (Qwen2-MoE). Each callable is an op of the op layer."""
    routed = experts(hidden, router(hidden))
    if shared is None:
        return routed
    gate_up, act, down, gate = shared
    out = down(act(gate_up(hidden)))
    if gate is not None:
        # The engine computes this [tokens, 1] sigmoid row-count-invariantly (vllm_cpu_sigmoid).
        out = row_invariant_sigmoid(gate(hidden)) * out
    return out + routed


class AlignedMoE:
    """vLLM's MoE layer (router + routed experts) over the trainer's per-expert weights.

    ``gate``, ``up``, ``down``: per-expert parameters ([I, H], [I, H], [H, I]) in expert order.
    ``gate_up``: instead of ``gate`` and ``up`` (pass None for both), per-expert ``[gate; up]``
    parameters ([2I, H], megatron-core's ``linear_fc1`` layout, which is vLLM's ``w13``).
    ``correction_bias``: the per-expert selection bias (sigmoid routing), or None.
    """

    def __init__(
        self,
        runtime: VllmRuntime,
        moe: MoeBlocks,
        hidden_size: int,
        gate: list,
        up: list,
        down: list,
        correction_bias: torch.nn.Parameter | None = None,
        *,
        gate_up: list | None = None,
    ):
        refuse_unsupported_engine(runtime)
        if gate_up is not None and (gate is not None or up is not None):
            raise ValueError("give either gate and up or gate_up, not both")
        first = [gate_up] if gate_up is not None else [gate, up]
        if any(len(w) != moe.num_experts for w in first + [down]):
            raise ValueError(f"expected {moe.num_experts} experts' gate/up/down weights")
        self.runtime = runtime
        self.moe = moe
        self.gate_up = None if gate_up is None else list(gate_up)
        self.gate, self.up = (None, None) if gate_up is not None else (list(gate), list(up))
        self.down = list(down)
        self.correction_bias = correction_bias
        self.params = (self.gate_up if gate_up is not None else self.gate + self.up) + self.down
        self.layer_name = f"zmrl_aligned_moe.{next(_layer_ids)}.experts"
        # vLLM's router keeps a reference to the bias tensor it was built with: the trainer's
        # values are copied into this one whenever they change.
        self._engine_bias = None
        if moe.e_score_correction_bias:
            if correction_bias is None:
                raise ValueError("this MoE routing needs its e_score_correction_bias")
            self._engine_bias = torch.zeros(moe.num_experts, dtype=torch.float32, device=runtime.device)
        self.runner = runtime.fused_moe(
            prefix=self.layer_name,
            num_experts=moe.num_experts,
            top_k=moe.top_k,
            hidden_size=hidden_size,
            intermediate_size=moe.moe_intermediate_size,
            renormalize=moe.norm_topk_prob,
            use_grouped_topk=moe.grouped_topk,
            num_expert_group=moe.n_group,
            topk_group=moe.topk_group,
            scoring_func=moe.scoring_func,
            routed_scaling_factor=moe.routed_scaling_factor,
            # As vLLM's GLM-4.5 / DeepSeek-V3 models on a non-ROCm platform: the runner scales
            # the routed output, the router's weights stay unscaled.
            apply_routed_scale_to_output=moe.grouped_topk,
            e_score_correction_bias=self._engine_bias,
            router_logits_dtype=torch.float32 if moe.grouped_topk else None,
        )
        self.experts = self.runner.routed_experts
        # The created (unprocessed) parameters: each re-derivation starts from their shape and
        # loader attributes, as a fresh checkpoint load would.
        self._created = {
            name: (tuple(p.shape), p.dtype, dict(vars(p)))
            for name, p in self.experts.named_parameters(recurse=False)
        }
        self._captured = None
        # The experts the last forward chose [T, K] (read by the bisect recorder).
        self.last_topk_ids = None
        self.runner.router.set_capture_fn(self._capture)
        sources = self.params + ([correction_bias] if correction_bias is not None else [])
        self.derived = DerivedWeight(sources, self._build)

    def _capture(self, topk_ids: torch.Tensor) -> None:
        self._captured = topk_ids

    def expert_weights(self, sources: list) -> tuple[list, list, list]:
        """(gate, up, down) per expert from tensors in the order of ``params``."""
        n = self.moe.num_experts
        if self.gate_up is None:
            return sources[:n], sources[n : 2 * n], sources[2 * n : 3 * n]
        width = self.moe.moe_intermediate_size
        fused = sources[:n]
        return [w[:width] for w in fused], [w[width:] for w in fused], sources[n : 2 * n]

    def param_grads(self, ggate: list, gup: list, gdown: list) -> list:
        """The gradients of ``params`` from the per-expert gate, up and down gradients."""
        if self.gate_up is None:
            first = ggate + gup
        else:
            first = [torch.cat([a, b]) for a, b in zip(ggate, gup)]
        return [g.to(p.dtype) for g, p in zip(first + gdown, self.params)]

    def _build(self, sources):
        """Load the expert weights through vLLM's weight loader, then its post-load processing."""
        rt = self.runtime
        experts = self.experts
        with rt.context():
            for name, (shape, dtype, attrs) in self._created.items():
                fresh = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=rt.device), requires_grad=False)
                for key, value in attrs.items():
                    setattr(fresh, key, value)
                setattr(experts, name, fresh)
            gate, up, down = self.expert_weights(sources)
            for shard, group in (("w1", gate), ("w3", up), ("w2", down)):
                param = experts.w2_weight if shard == "w2" else experts.w13_weight
                for e, w in enumerate(group):
                    ok = param.weight_loader(
                        param=param,
                        loaded_weight=w.to(rt.dtype),
                        weight_name=f"{self.layer_name}.{e}.{shard}.weight",
                        shard_id=shard,
                        expert_id=e,
                        return_success=True,
                    )
                    if not ok:
                        raise RuntimeError(f"vLLM's MoE weight loader refused expert {e} {shard}")
            if self._engine_bias is not None:
                self._engine_bias.copy_(sources[len(self.params)].float())
            # Each derivation is a first load (see reprocess_moe_as_first_load).
            reprocess_moe_as_first_load(experts)
            experts.quant_method.process_weights_after_loading(experts)
        return self.runner

    def kernel(self, hidden: torch.Tensor, router_logits: torch.Tensor):
        """vLLM's MoE layer on (hidden [T, H], router logits [T, E]): (routed output, top-k ids)."""
        from vllm.forward_context import set_forward_context

        runner = self.derived.get()
        self._captured = None
        with self.runtime.context(), set_forward_context(
            None, self.runtime.vllm_config, num_tokens=hidden.shape[0]
        ):
            out = runner.forward(hidden.clone(), router_logits.clone())
        ids = self._captured
        self._captured = None
        if ids is None:
            raise RuntimeError("vLLM's router did not report the experts it chose")
        self.last_topk_ids = ids.clone()
        return out, ids.clone()

    @_observable
    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor, params: list | None = None) -> torch.Tensor:
        """``params``: tensors with the values of ``params`` to take the gradients instead (views
        of stacked expert weights taken in this forward, so that autograd runs their backward with
        this forward's other nodes)."""
        return _MoEFn.apply(hidden, router_logits, self, *(self.params if params is None else params))


def experts_backward(x, g, ids, weights, gate, up, down):
    """fp32 gradients of out[t] = sum_k weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t),
    e = ids[t, k]: returns (d x, d weights, [d gate_e], [d up_e], [d down_e]).

    vLLM's fused kernel keeps none of its intermediates, so the gate and up products are
    recomputed; the down product is not: d weights[t, k] = (g_t down_e) . h_t comes from the d h
    product the backward needs anyway. The (token, slot) rows are sorted by expert once (one
    gather of x and g), so each expert's rows are one contiguous block: its matmuls write into
    row blocks of shared buffers and every elementwise step runs once over all rows.
    """
    x32, g32 = x.float(), g.float()
    tokens, k = ids.shape
    width = gate[0].shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(gate)).tolist()
    rows_token = order // k
    xs = x32.index_select(0, rows_token)  # [tokens * k, H], grouped by expert
    gs = g32.index_select(0, rows_token)
    ws = weights.reshape(-1).float().index_select(0, order).unsqueeze(-1)
    blocks, start = [], 0
    for n in counts:
        blocks.append(slice(start, start + n))
        start += n
    weights_of = [(gate[e].detach().float(), up[e].detach().float(), down[e].detach().float())
                  for e in range(len(gate))]

    a, b, gh = (xs.new_empty(xs.shape[0], width) for _ in range(3))
    for (wg, wu, wd), rows, n in zip(weights_of, blocks, counts):
        if n:
            torch.mm(xs[rows], wg.t(), out=a[rows])
            torch.mm(xs[rows], wu.t(), out=b[rows])
            torch.mm(gs[rows], wd, out=gh[rows])  # d out / d h before the routing weight
    silu_a = torch.nn.functional.silu(a)
    h = silu_a * b
    gw_rows = torch.einsum("ni,ni->n", gh, h)
    h.mul_(ws)  # h * weight: d down = g^T (h * weight)
    gh.mul_(ws)
    gb = silu_a.mul_(gh)
    ga = torch.ops.aten.silu_backward(gh.mul_(b), a)

    gx_rows = torch.empty_like(xs)
    ggate, gup, gdown = [], [], []
    for (wg, wu, wd), rows, n in zip(weights_of, blocks, counts):
        if n == 0:
            ggate.append(torch.zeros_like(wg))
            gup.append(torch.zeros_like(wu))
            gdown.append(torch.zeros_like(wd))
            continue
        xe = xs[rows]
        gdown.append(gs[rows].t() @ h[rows])
        ggate.append(ga[rows].t() @ xe)
        gup.append(gb[rows].t() @ xe)
        torch.mm(ga[rows], wg, out=gx_rows[rows]).addmm_(gb[rows], wu)
    # Back to (token, slot) order: each row written once, then summed over the slots (a
    # scatter-add into the tokens would serialise on this CPU).
    gx_slots = torch.empty_like(gx_rows).index_copy_(0, order, gx_rows)
    gweights = torch.empty_like(gw_rows).index_copy_(0, order, gw_rows).view(tokens, k)
    return gx_slots.view(tokens, k, -1).sum(1), gweights, ggate, gup, gdown


class _MoEFn(Function):
    @staticmethod
    def forward(ctx, hidden, router_logits, moe: AlignedMoE, *params):
        out, ids = moe.kernel(hidden, router_logits)
        ctx.save_for_backward(hidden, router_logits, ids)
        ctx.moe = moe
        return out

    @staticmethod
    def backward(ctx, g):
        hidden, router_logits, ids = ctx.saved_tensors
        moe = ctx.moe
        with torch.enable_grad():
            logits = router_logits.detach().float().requires_grad_(True)
            weights = routing_weights(logits, ids, moe.moe)
        gx, gweights, ggate, gup, gdown = experts_backward(
            hidden, g, ids.long(), weights.detach(), *moe.expert_weights(moe.params)
        )
        (glogits,) = torch.autograd.grad(weights, logits, gweights)
        grads = moe.param_grads(ggate, gup, gdown)
        return (gx.to(hidden.dtype), glogits.to(router_logits.dtype), None, *grads)
