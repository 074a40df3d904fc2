"""The Mixture-of-Experts op: vLLM's router and fused-experts layer forward, torch backward.

The forward is vLLM's own MoE layer built under the engine's ``VllmConfig`` and loaded with the
trainer's expert weights, so its numerics are the engine's; the backward is plain fp32 torch
(experts, and router logits through the top-k weights). See docs/zero-mismatch.md.
"""

from __future__ import annotations

import itertools

import torch
from torch.autograd import Function

from zero_mismatch_plugin.aligned.derived import DerivedWeight
from zero_mismatch_plugin.aligned.ops import observable
from zero_mismatch_plugin.aligned.runtime import VllmRuntime
from zero_mismatch_plugin.tables.architectures import MoeBlocks
from zero_mismatch_plugin.aligned.cpu_weight_reload import reprocess_moe_as_first_load
from zero_mismatch_plugin.aligned.moe_backward import experts_backward, experts_lora_backward, in_parameter_order
from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid

_layer_ids = itertools.count()


def refuse_unsupported_engine(runtime: VllmRuntime, engine_rank_shard: bool = False) -> None:
    """Engine settings under which vLLM's MoE layer would not be this one-process layer
    (``engine_rank_shard``: the layer holds one tensor-parallel engine rank's shard of every
    expert, which that rank runs as this layer runs it)."""
    cfg = runtime.vllm_config
    par = cfg.parallel_config
    problems = []
    if par.tensor_parallel_size != 1 and not engine_rank_shard:
        problems.append(f"tensor_parallel_size={par.tensor_parallel_size}: use 1")
    if par.data_parallel_size != 1:
        problems.append(f"data_parallel_size={par.data_parallel_size}: use 1")
    if par.enable_expert_parallel:
        problems.append("enable_expert_parallel (expert parallelism): leave it off")
    if par.enable_eplb:
        problems.append("enable_eplb (redundant experts): leave it off")
    if cfg.model_config.quantization is not None:
        problems.append(f"quantization={cfg.model_config.quantization!r}: use unquantized experts")
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
    ``experts(hidden, router(hidden))`` plus, where ``shared`` is given, the shared expert
    (:func:`shared_expert_output`). Each callable is an op of the op layer."""
    routed = experts(hidden, router(hidden))
    if shared is None:
        return routed
    return shared_expert_output(hidden, shared) + routed


def shared_expert_output(hidden: torch.Tensor, shared) -> torch.Tensor:
    """``down(act(gate_up(hidden)))`` for ``shared`` = (gate_up, act, down, gate or None), scaled by
    ``sigmoid(gate(hidden))`` where it has a gate (Qwen2-MoE)."""
    gate_up, act, down, gate = shared
    out = down(act(gate_up(hidden)))
    if gate is not None:
        # The engine computes this [tokens, 1] sigmoid row-count-invariantly (vllm_cpu_sigmoid).
        out = row_invariant_sigmoid(gate(hidden)) * out
    return out


class AlignedMoE:
    """vLLM's MoE layer (router + routed experts) over the trainer's per-expert weights.

    ``gate``, ``up``, ``down``: per-expert parameters ([I, H], [I, H], [H, I]) in expert order.
    ``gate_up``: instead of ``gate`` and ``up`` (pass None for both), per-expert ``[gate; up]``
    parameters ([2I, H], megatron-core's ``linear_fc1`` layout, which is vLLM's ``w13``).
    ``correction_bias``: the per-expert selection bias (sigmoid routing), or None.
    ``engine_rank_shard``: the weights are one tensor-parallel rank's shards (``moe`` then gives
    that rank's expert width), the layer computes what that engine rank's layer computes.
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
        engine_rank_shard: bool = False,
    ):
        refuse_unsupported_engine(runtime, engine_rank_shard)
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
            # the routed output, the router's weights stay unscaled (Kimi's: the weights scaled).
            apply_routed_scale_to_output=moe.grouped_topk and not moe.routed_scale_on_weights,
            e_score_correction_bias=self._engine_bias,
            router_logits_dtype=torch.float32 if moe.grouped_topk else None,
        )
        self.experts = self.runner.routed_experts
        # With LoRA enabled on CPU the engine runs the plugin's LoRA-capable CPU experts
        # (vllm_cpu_moe_lora, consistent mode); this layer is given the same class. Elsewhere
        # vLLM's own choice (a LoRA-capable GPU kernel) stands.
        self.lora_capable = runtime.vllm_config.lora_config is not None
        if self.lora_capable:
            from zero_mismatch_plugin.aligned.cpu_lora_experts import use_cpu_lora_experts

            use_cpu_lora_experts(self.experts.quant_method)
            experts_cls = getattr(self.experts.quant_method, "experts_cls", None)
            if experts_cls is None or not experts_cls.supports_lora():
                raise NotImplementedError(
                    f"enable_lora on an MoE model: vLLM's experts {getattr(experts_cls, '__name__', experts_cls)} "
                    "take no LoRA updates; serve the model without enable_lora"
                )
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
        self.derived = DerivedWeight(sources, self._build, copies=True)  # loaded into fresh parameters

    def _capture(self, topk_ids: torch.Tensor) -> None:
        self._captured = topk_ids

    def packed_gemm_weights(self) -> dict:
        """{name: expert 0's gate/up and down weight} as the LoRA-capable CPU experts pack them (one
        shape per layer: what the trainer's probe checks); empty for vLLM's own experts."""
        if not self.lora_capable:
            return {}
        experts = self.derived.get().routed_experts
        return {f"{self.layer_name}.w13": experts.w13_weight[0], f"{self.layer_name}.w2": experts.w2_weight[0]}

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

    def kernel(self, hidden: torch.Tensor, router_logits: torch.Tensor, lora_context=None, capture_gate_up=None):
        """vLLM's MoE layer on (hidden [T, H], router logits [T, E]): (routed output, top-k ids).
        ``lora_context``: vLLM's ``MoELoRAContext`` the experts consume (None: no adapter);
        ``capture_gate_up``: a hook the CPU LoRA-capable experts give their gate/up pre-activations
        (:func:`..cpu_lora_experts.cpu_moe_experts`)."""
        from vllm.forward_context import set_forward_context

        runner = self.derived.get()
        self._captured = None
        fused = runner.routed_experts.quant_method.moe_kernel.fused_experts if self.lora_capable else None
        if fused is not None:
            fused.set_lora_context(lora_context)
            fused._capture_gate_up = capture_gate_up
        try:
            with self.runtime.context(), set_forward_context(
                None, self.runtime.vllm_config, num_tokens=hidden.shape[0]
            ):
                out = runner.forward(hidden.clone(), router_logits.clone())
        finally:
            if fused is not None:
                fused.set_lora_context(None)
                fused._capture_gate_up = None
        ids = self._captured
        self._captured = None
        if ids is None:
            raise RuntimeError("vLLM's router did not report the experts it chose")
        self.last_topk_ids = ids.clone()
        return out, ids.clone()

    @observable
    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor, params: list | None = None) -> torch.Tensor:
        """``params``: tensors with the values of ``params`` to take the gradients instead (views
        of stacked expert weights taken in this forward, so that autograd runs their backward with
        this forward's other nodes)."""
        return _MoEFn.apply(hidden, router_logits, self, *(self.params if params is None else params))


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
        (glogits,) = torch.autograd.grad(weights, logits, gweights.to(weights.dtype))
        grads = moe.param_grads(ggate, gup, gdown)
        return (gx.to(hidden.dtype), glogits.to(router_logits.dtype), None, *grads)


# ----- LoRA on the routed experts ------------------------------------------------------------

EXPERT_SLICES = ("gate_proj", "up_proj", "down_proj")


def expert_lora_weights(sources: list, num_experts: int) -> dict[str, tuple[list, list]]:
    """{target: ([A_e], [B_e])} from the experts' adapter matrices listed target by target, expert
    by expert, A before B (the order of :class:`AlignedMoELoRA`'s ``params``)."""
    out = {}
    for i, target in enumerate(EXPERT_SLICES):
        block = sources[2 * num_experts * i : 2 * num_experts * (i + 1)]
        out[target] = (block[0::2], block[1::2])
    return out


def stacked_expert_lora(weights: dict[str, tuple[list, list]], max_rank: int, lora_dtype, scaling: float, device):
    """(w13 A, w13 B, w2 A, w2 B) stacked as vLLM's ``FusedMoEWithLoRA`` holds them: per slice
    [1, E, max_rank, in] and [1, E, out, max_rank], A and B zero-padded to ``max_rank``, B cast to
    the LoRA dtype then scaled (``weights``: :func:`expert_lora_weights`)."""
    stacked = {}
    for target, (a_list, b_list) in weights.items():
        r = a_list[0].shape[0]
        a = torch.zeros(1, len(a_list), max_rank, a_list[0].shape[1], dtype=lora_dtype)
        b = torch.zeros(1, len(b_list), b_list[0].shape[0], max_rank, dtype=lora_dtype)
        for e, (lora_a, lora_b) in enumerate(zip(a_list, b_list)):
            a[0, e, :r] = lora_a.to(lora_dtype)
            scaled = lora_b.to(lora_dtype, copy=True)  # never scale the parameter itself
            if scaling != 1:
                scaled *= scaling
            b[0, e, :, :r] = scaled
        stacked[target] = (a.to(device), b.to(device))
    return (
        (stacked["gate_proj"][0], stacked["up_proj"][0]),
        (stacked["gate_proj"][1], stacked["up_proj"][1]),
        (stacked["down_proj"][0],),
        (stacked["down_proj"][1],),
    )


class AlignedMoELoRA:
    """vLLM's MoE layer over a frozen :class:`AlignedMoE` with a trainable adapter on every routed
    expert (gate, up and down), in vLLM's expert-LoRA arithmetic.

    ``experts[e]`` maps ``gate_proj`` / ``up_proj`` / ``down_proj`` to the expert's adapter
    (``lora_A`` [r, in], ``lora_B`` [out, r]). The forward is the base layer's with vLLM's
    ``MoELoRAContext`` built from them as the engine's ``FusedMoEWithLoRA`` builds it (one slot,
    A and B zero-padded to ``max_lora_rank``, B cast to the LoRA dtype then scaled); the experts
    (on CPU the plugin's ``vllm_cpu_moe_lora`` ones) add the updates exactly as in the engine. The
    backward, for the input, the router logits and A and B (the base is frozen), is fp32 torch.
    """

    def __init__(self, runtime, base: AlignedMoE, experts: list[dict], lora_config, mapping):
        lora = runtime.vllm_config.lora_config
        if lora is None or not base.lora_capable:
            raise ValueError("the trainer's engine arguments need enable_lora=True (as the engine's)")
        if lora_config.r > lora.max_lora_rank:
            raise ValueError(f"adapter rank {lora_config.r} > max_lora_rank {lora.max_lora_rank}: raise max_lora_rank")
        if len(experts) != base.moe.num_experts:
            raise ValueError(f"expected an adapter for each of the {base.moe.num_experts} routed experts")
        self.runtime = runtime
        self.base = base
        self.moe = base.moe
        self.experts = experts
        self.scaling = lora_config.scaling
        self.max_rank = lora.max_lora_rank
        self.lora_dtype = lora.lora_dtype
        self.mapping = mapping
        self.params = [t for target in EXPERT_SLICES for e in experts for t in (e[target].lora_A, e[target].lora_B)]
        self.derived = DerivedWeight(self.params, self._build, copies=True)  # vLLM's stacked buffers

    def lora_weights(self, sources: list) -> dict[str, tuple[list, list]]:
        """{target: ([A_e], [B_e])} from tensors in the order of ``params``."""
        return expert_lora_weights(sources, len(self.experts))

    def _build(self, sources):
        return stacked_expert_lora(self.lora_weights(sources), self.max_rank, self.lora_dtype, self.scaling,
                                   self.runtime.device)

    def lora_context(self, num_tokens: int):
        """vLLM's ``MoELoRAContext`` over the trainer's adapter, every token in slot 0."""
        from vllm.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext

        w13_a, w13_b, w2_a, w2_b = self.derived.get()
        return MoELoRAContext(
            w13_lora_a_stacked=w13_a, w13_lora_b_stacked=w13_b, w2_lora_a_stacked=w2_a, w2_lora_b_stacked=w2_b,
            adapter_enabled=torch.tensor([1, 0], dtype=torch.int, device=self.runtime.device), max_loras=1,
            top_k=self.moe.top_k, w13_num_slices=2, fully_sharded=False, tp_rank=0, tp_size=1,
            local_num_experts=self.moe.num_experts, punica_wrapper=self._punica(num_tokens),
            use_tuned_config=False,
        )

    def _punica(self, num_tokens: int):
        wrapper = self.mapping.get(num_tokens)
        if self.runtime.platform == "cpu":
            from zero_mismatch_plugin.aligned.cpu_lora_experts import with_torch_moe_lora

            with_torch_moe_lora(wrapper)  # the CPU wrapper has no expert-LoRA methods of its own
        return wrapper

    def kernel(self, hidden: torch.Tensor, router_logits: torch.Tensor):
        return self.base.kernel(hidden, router_logits, self.lora_context(hidden.shape[0]))

    def kernel_keeping_gate_up(self, hidden: torch.Tensor, router_logits: torch.Tensor):
        """:meth:`kernel` and the experts' gate/up pre-activations (rows sorted by expert) where
        they are fp32, which the backward then takes instead of recomputing them (None otherwise:
        in half precision the backward recomputes them in fp32)."""
        kept = []
        out, ids = self.base.kernel(hidden, router_logits, self.lora_context(hidden.shape[0]), kept.append)
        gate_up = None
        if kept and all(part.dtype == torch.float32 for part in kept):
            gate_up = kept[0] if len(kept) == 1 else torch.cat(kept)
        return out, ids, gate_up

    def packed_gemm_weights(self) -> dict:
        """{name: expert 0's A and B of each slice} as the CPU experts pack them (the probe's shapes)."""
        names = ("w13_a", "w13_b", "w2_a", "w2_b")
        return {f"{self.base.layer_name}.lora.{name}{i}": stacked[0, 0]
                for name, group in zip(names, self.derived.get()) for i, stacked in enumerate(group)}

    @observable
    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return _MoELoRAFn.apply(hidden, router_logits, self, *self.params)


def experts_with_lora(x, weights, ids, gate, up, down, lora, scaling):
    """out[t] = sum_k weights[t, k] * down'_e(silu(gate'_e x_t) * up'_e x_t), e = ids[t, k], where
    each linear' is W x + scaling * B (A x): the routed experts with a LoRA adapter, in plain
    differentiable torch (the backward's graph). ``lora``: {target: ([A_e], [B_e])}, or None for
    the experts alone."""
    out = x.new_zeros(x.shape[0], down[0].shape[0])

    def linear(v, weight, target, e):
        base = v @ weight[e].t()
        if lora is None:
            return base
        a, b = lora[target]
        return base + scaling * ((v @ a[e].t()) @ b[e].t())

    for e in torch.unique(ids).tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        xe = x.index_select(0, tokens)
        h = torch.nn.functional.silu(linear(xe, gate, "gate_proj", e)) * linear(xe, up, "up_proj", e)
        d = linear(h, down, "down_proj", e)
        out = out.index_add(0, tokens, d * weights[tokens, slots].unsqueeze(-1))
    return out


class _MoELoRAFn(Function):
    @staticmethod
    def forward(ctx, hidden, router_logits, op: AlignedMoELoRA, *params):
        out, ids, gate_up = op.kernel_keeping_gate_up(hidden, router_logits)
        ctx.save_for_backward(hidden, router_logits, ids, gate_up, *params)
        ctx.op = op
        return out

    @staticmethod
    def backward(ctx, g):
        hidden, router_logits, ids, gate_up, *params = ctx.saved_tensors
        op = ctx.op
        base = op.base
        with torch.enable_grad():
            logits = router_logits.detach().float().requires_grad_(True)
            weights = routing_weights(logits, ids, op.moe)
        gx, gweights, lora_grads = experts_lora_backward(
            hidden, g, ids.long(), weights.detach(), *base.expert_weights(base.params),
            op.lora_weights(params), op.scaling, gate_up=gate_up)
        (glogits,) = torch.autograd.grad(weights, logits, gweights)
        gparams = in_parameter_order(lora_grads)  # None for an expert no token chose this step
        return (gx.to(hidden.dtype), glogits.to(router_logits.dtype), None,
                *(None if gp is None else gp.to(p.dtype) for gp, p in zip(gparams, params)))
