"""megatron-core's MoE layer and router with vLLM's numerics (the op layer's MoE op).

At tensor parallelism > 1 (with sequence parallelism, as megatron requires for MoE) each rank holds
the engine rank's shard of every expert and of the shared expert: the router runs on the rank's
tokens, logits and tokens are gathered, the rank's shards give a partial output (vLLM's kernel on
the shard, then the shared expert's partial), and the ranks' partials are summed as vLLM's
all-reduce after its MoE layer sums them.

At expert parallelism > 1 each rank holds megatron's share of the experts; every (token, slot) row
goes through megatron's own token dispatcher (``allgather`` or ``alltoall``) to the rank of its
expert and back, and the slots are summed as vLLM's one-process kernel sums them
(:mod:`..aligned.expert_parallel`).

Both together (expert tensor parallelism 1): the engine at the same tensor parallelism splits
every expert over its ranks, so the expert's rank computes each (token, slot) row once per engine
rank's shard; each shard's slots are summed as that engine rank's kernel sums them, its shared
expert partial added, and the engine ranks' partials summed in rank order."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from zero_mismatch_plugin.aligned import ops
from zero_mismatch_plugin.aligned.derived import OpCache, shared_ops
from zero_mismatch_plugin.aligned.runtime import VllmRuntime
from zero_mismatch_plugin.faces.megatron import parallel
from zero_mismatch_plugin.faces.megatron.modules import flat_tokens, megatron_parameter
from zero_mismatch_plugin.tables.architectures import describe


class AlignedRouter(nn.Module):
    """The ``router`` of megatron's MoE layer as the aligned MoE layer uses it: megatron's router
    parameters (``weight`` [E, H]; the ``expert_bias`` buffer where the routing has a selection
    bias) and vLLM's gate linear for the logits (``router(x)`` -> [T, E]). Choosing the experts
    and weighting them is vLLM's router, inside the op layer's MoE op."""

    def __init__(self, config, pg_collection=None, *, runtime: VllmRuntime, **_):
        super().__init__()
        self.config = config
        self.runtime = runtime
        self.layer_number = None
        experts = config.num_moe_experts
        self.weight = megatron_parameter(torch.empty(experts, config.hidden_size, dtype=config.params_dtype))
        if getattr(config, "perform_initialization", True):
            with torch.no_grad():
                config.init_method(self.weight)
        if config.moe_router_enable_expert_bias:
            # megatron's names; finalize_model_grads reads both (and leaves the bias unchanged at
            # moe_router_bias_update_rate=0, which the aligned spec requires).
            self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(experts), persistent=False)
        else:
            self.expert_bias = None
        self._aligned_ops = OpCache()

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def _kernel(self) -> ops.AlignedLinear:
        # Rebuilt if the Parameter object was replaced (e.g. by a model conversion).
        return self._aligned_ops.get("gate", [self.weight], lambda: ops.AlignedLinear(self.runtime, [self.weight]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel()(x)

    def refresh(self) -> None:
        self._kernel().derived.refresh()


def moe_config_mismatches(config, blocks) -> list[str]:
    """How megatron's MoE settings in ``config`` differ from the MoE layers of the checkpoint
    vLLM serves (``blocks``: its :class:`~..architectures.Blocks`), as settings to change."""
    moe = blocks.moe
    if moe is None:
        return ["num_moe_experts: the checkpoint vLLM serves has no MoE layers"]
    wanted = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.moe_intermediate_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_score_function=moe.scoring_func,
        moe_router_enable_expert_bias=moe.e_score_correction_bias,
    )
    out = [f"{k}={v!r} (not {getattr(config, k, None)!r})" for k, v in wanted.items() if getattr(config, k, None) != v]
    freq = getattr(config, "moe_layer_freq", 1)
    layers = range(config.num_layers)
    pattern = [int(i % freq == 0) for i in layers] if isinstance(freq, int) else list(freq)
    engine = [int(blocks.mlp_kind(i) == "moe") for i in layers]
    if pattern != engine:
        out.append(f"moe_layer_freq={engine} (not {freq!r}): the checkpoint's MoE and dense layers")
    return out



@functools.cache
def aligned_moe_layer_class():
    """``AlignedMoELayer``, defined on first use (megatron-core is imported then)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from zero_mismatch_plugin.aligned.moe import AlignedMoE, AlignedMoELoRA, moe_mlp

    class AlignedMoELayer(MoELayer):
        """megatron-core's MoE layer (router, experts, shared experts: megatron's modules and
        parameter names) computed as vLLM computes it: the router's logits by vLLM's gate linear,
        expert choice, experts and combine by the op layer's MoE op (vLLM's fused-MoE layer fed
        the experts' ``linear_fc1``/``linear_fc2`` weights), the shared expert by vLLM's linears
        and ``SiluAndMul``. At expert parallelism > 1 megatron's token dispatcher moves the
        (token, slot) rows (:meth:`_expert_parallel_routed`); at tensor parallelism > 1 each rank
        computes its shard's partial (:meth:`_tensor_parallel_forward`)."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *, runtime: VllmRuntime, **_):
            blocks = describe(runtime.hf_config)
            problems = moe_config_mismatches(config, blocks)
            if problems:
                raise NotImplementedError(
                    "aligned megatron MoE layer: megatron's config differs from the checkpoint vLLM "
                    "serves; set " + "; ".join(problems)
                )
            super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
            self.expert_parallel = self.num_local_experts != config.num_moe_experts
            self.tp_group = parallel.tensor_parallel_group(config)
            moe = blocks.moe
            # The engine's tensor-parallel ranks each hold a shard of every expert; at expert
            # parallelism the trainer keeps experts whole and computes each engine shard's output.
            self.engine_shards = 1
            if self.tp_group is not None:
                if not config.sequence_parallel:
                    raise NotImplementedError("aligned megatron MoE layer at tensor parallelism > 1: set "
                                              "sequence_parallel=True (megatron requires it for MoE training)")
                etp = config.expert_tensor_parallel_size or 1
                if self.expert_parallel and etp != 1:
                    raise NotImplementedError(
                        f"aligned megatron MoE layer: expert_tensor_parallel_size={etp} with expert parallelism: "
                        "set it to 1 (each expert whole on its rank, computed as the engine's ranks split it)")
                if not self.expert_parallel and etp != self.tp_group.size():
                    raise NotImplementedError(
                        f"aligned megatron MoE layer: expert_tensor_parallel_size={config.expert_tensor_parallel_size} "
                        f"at tensor parallelism {self.tp_group.size()}: vLLM splits every expert over its "
                        "tensor-parallel ranks; set them equal")
                parallel.divide(moe.moe_intermediate_size, self.tp_group.size(), "the expert width")
                if self.expert_parallel:
                    self.engine_shards = self.tp_group.size()
                else:
                    moe = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size // self.tp_group.size())
                # Seen on this rank's tokens (the router) or giving this rank's partial (the shared
                # expert's gate): megatron's finalize_model_grads sums their grads over the ranks.
                for weight in (self.router.weight, getattr(self.shared_experts, "gate_weight", None)):
                    if weight is not None:
                        setattr(weight, "sequence_parallel", True)
            if not isinstance(self.router, AlignedRouter):
                raise NotImplementedError("aligned megatron MoE layer: its router must be AlignedRouter")
            self.runtime = runtime
            self.moe = moe
            self.act = shared_ops(runtime).get("silu_and_mul", [], lambda: ops.AlignedSiluAndMul(runtime))
            # Rebuilt if a Parameter object was replaced (e.g. by a model conversion).
            self._aligned_ops = OpCache()

        def _experts_op(self) -> AlignedMoE:
            if self.expert_parallel:
                return self._local_experts_op()
            fc1 = [e.linear_fc1.weight for e in self.experts.local_experts]
            fc2 = [e.linear_fc2.weight for e in self.experts.local_experts]
            bias = self.router.expert_bias
            return self._aligned_ops.get(
                "experts",
                fc1 + fc2 + [bias],
                lambda: AlignedMoE(self.runtime, self.moe, self.config.hidden_size, None, None, fc2, bias, gate_up=fc1,
                                   engine_rank_shard=self.tp_group is not None),
            )

        def _routed_op(self):
            """The experts' op, with an adapter on the routed experts (``lora`` on every local
            expert's ``linear_fc1`` and ``linear_fc2``, :func:`..lora.attach_lora`) vLLM's MoE
            layer with their LoRA updates over it."""
            base = self._experts_op()
            experts, first = self._expert_adapters()
            if experts is None:
                return base
            params = [p for e in experts for pair in e.values() for p in (pair.lora_A, pair.lora_B)]
            return self._aligned_ops.get(
                "routed_lora",
                [base] + params,
                lambda: AlignedMoELoRA(self.runtime, base, experts, first.lora_config, first.mapping),
            )

        def _expert_adapters(self):
            """(per local expert {target: LoRAPair}, the first expert's fc1 adapter) of the adapter
            attached to the routed experts (:func:`..lora.attach_lora`), or (None, None)."""
            local = self.experts.local_experts
            adapters = [(getattr(e.linear_fc1, "lora", None), getattr(e.linear_fc2, "lora", None)) for e in local]
            if all(a is None and b is None for a, b in adapters):
                return None, None
            if any(a is None or b is None for a, b in adapters):
                raise ValueError("aligned megatron MoE layer: an adapter on some routed experts' linears only; "
                                 "attach it to linear_fc1 and linear_fc2 of every expert (megatron.lora.attach_lora)")
            return [{t: getattr(lora, t) for lora in pair for t in lora.targets} for pair in adapters], adapters[0][0]

        def _shared_ops(self):
            shared = self.shared_experts
            if shared is None:
                return None
            gate = None
            if shared.gate_weight is not None:
                weight = shared.gate_weight
                gate = self._aligned_ops.get(
                    "shared_expert_gate", [weight], lambda: ops.AlignedLinear(self.runtime, [weight]))
            return (shared.linear_fc1.op(), self.act, shared.linear_fc2.op(), gate)

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            if intermediate_tensors is not None:
                raise NotImplementedError("aligned megatron MoE layer: partial (CUDA-graph) MoE forwards")
            if self.tp_group is not None and self.expert_parallel:
                return self._tensor_expert_parallel_forward(hidden_states), None
            if self.tp_group is not None:
                return self._tensor_parallel_forward(hidden_states), None
            routed = self._expert_parallel_experts() if self.expert_parallel else self._routed_op()
            out = moe_mlp(flat_tokens(hidden_states), self.router, routed, self._shared_ops())
            return out.reshape(hidden_states.shape), None

        def _tensor_parallel_forward(self, hidden_states):
            """This rank's tokens in, this rank's tokens out (sequence parallelism): the router on
            the rank's tokens, its logits and the tokens gathered, the rank's partial MoE output
            (shards of every expert and of the shared expert), the partials reduce-scattered."""
            group = self.tp_group
            local = flat_tokens(hidden_states)
            logits = parallel.column_input(self.router(local), group, True)
            tokens = parallel.column_input(local, group, True)
            partial = moe_mlp(tokens, lambda _: logits, self._routed_op(), self._shared_ops())
            return parallel.row_output(partial, group, True).reshape(hidden_states.shape)

        def _tensor_expert_parallel_forward(self, hidden_states):
            """This rank's tokens in and out (sequence parallelism), experts whole on their
            expert-parallel ranks: for each engine rank, its routed partial (every (token, slot)
            row's output on that rank's shard of the expert, the slots summed as its kernel sums
            them) plus its shared expert's partial; the engine ranks' partials then summed in rank
            order, as vLLM's all-reduce after its MoE layer sums them."""
            from zero_mismatch_plugin.aligned.expert_parallel import EngineRankRoutedOutput
            from zero_mismatch_plugin.aligned.moe import shared_expert_output
            from zero_mismatch_plugin.aligned.reductions import all_gather_parts, rank_order_sum

            group = self.tp_group
            local = flat_tokens(hidden_states)
            partials = self._expert_parallel_routed_per_shard(local, self.router(local))
            # Every rank's tokens' choices, as the other layouts report them (a few integers).
            self._last_topk_ids = torch.cat(all_gather_parts(self._last_topk_ids, group))
            if ops.observing():  # zmrl bisect: the engine rank of this rank's index, every token
                EngineRankRoutedOutput(group, self._last_topk_ids)(partials)
            shared = self._shared_ops()
            if shared is not None:
                # This rank's shared-expert partial for every token, then every rank's for this
                # rank's tokens (gathered; the backward sums each rank's rows back to it).
                mine = shared_expert_output(parallel.column_input(local, group, True), shared)
                every = parallel.column_input(mine, group, True).view(group.size(), *mine.shape)
                rows = slice(parallel.group_rank(group) * local.shape[0], (parallel.group_rank(group) + 1) * local.shape[0])
                partials = [every[r, rows] + routed for r, routed in enumerate(partials)]
            return rank_order_sum(partials).reshape(hidden_states.shape)

        @property
        def last_topk_ids(self):
            """The experts the engine's router chose in the last forward [T, K] (None before one)."""
            if self.expert_parallel:
                return getattr(self, "_last_topk_ids", None)
            return self._experts_op().last_topk_ids

        # ----- expert parallelism -----------------------------------------------------------

        def _local_experts_op(self, shard: int = 0):
            """vLLM's experts over this rank's experts, computing engine rank ``shard``'s share of each."""
            from zero_mismatch_plugin.aligned.expert_parallel import AlignedExpertRows

            fc1 = [e.linear_fc1.weight for e in self.experts.local_experts]
            fc2 = [e.linear_fc2.weight for e in self.experts.local_experts]
            return self._aligned_ops.get(
                f"local_experts.{shard}", fc1 + fc2,
                lambda: AlignedExpertRows(self.runtime, self.moe, self.config.hidden_size, fc1, fc2,
                                          engine_shard=(shard, self.engine_shards)))

        def _engine_router(self):
            from zero_mismatch_plugin.aligned.expert_parallel import EngineRouter

            bias = self.router.expert_bias
            return self._aligned_ops.get("engine_router", [bias], lambda: EngineRouter(self.runtime, self.moe, bias))

        def _expert_parallel_experts(self):
            from zero_mismatch_plugin.aligned.expert_parallel import ExpertParallelExperts

            return ExpertParallelExperts(self._expert_parallel_routed, lambda: self.last_topk_ids)

        def _expert_parallel_routed(self, x, router_logits):
            """The routed experts' output [T, H] at expert parallelism: the engine's router, then
            each (token, slot) row dispatched by megatron to its expert's rank as a token routed to
            that one expert with probability 1, its output returned unsummed, and the slots summed
            in the engine kernel's order and rounding."""
            (routed,) = self._expert_parallel_routed_per_shard(x, router_logits)
            return routed

        def _expert_parallel_routed_per_shard(self, x, router_logits) -> list:
            """:meth:`_expert_parallel_routed` once per engine tensor-parallel rank (that rank's
            shard of each expert): one dispatch, one combine per shard."""
            from zero_mismatch_plugin.aligned.expert_parallel import (probe_combine_arithmetic, slot_order_combine,
                                                                      slot_order_sum)
            from zero_mismatch_plugin.faces.megatron.parallel import cpu_megatron_collectives

            router = self._engine_router()
            weights, ids = router.route(x, router_logits)
            self._last_topk_ids = ids
            tokens, k = ids.shape
            rows = x.repeat_interleave(k, dim=0)
            routing_map = torch.nn.functional.one_hot(ids.reshape(-1), self.config.num_moe_experts).bool()
            serving_lora = self.runtime.vllm_config.lora_config is not None
            # Serving LoRA, the engine weights each slot before summing (the rows travel with their
            # weight); otherwise each row comes back unweighted and the kernel's combine weights it.
            probs = routing_map.to(weights.dtype) * weights.reshape(-1, 1) if serving_lora else routing_map.to(x.dtype)
            dispatcher = self.token_dispatcher
            outputs = []
            with cpu_megatron_collectives():
                rows, probs = dispatcher.dispatch_preprocess(rows, routing_map, probs)
                rows, probs = dispatcher.token_dispatch(rows, probs)
                rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(rows, probs)
                counts = torch.as_tensor(tokens_per_expert, device=rows.device).long()
                local_ids = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts)
                for shard in range(self.engine_shards):
                    # megatron's combine keeps no state of its own: it runs once per shard.
                    if serving_lora:
                        out = self._local_experts_lora_op(shard)(rows, row_probs.reshape(-1), local_ids)
                    else:
                        out = self._local_experts_op(shard)(rows, local_ids)
                    out = dispatcher.combine_preprocess(out)
                    out = dispatcher.token_combine(out)
                    outputs.append(dispatcher.combine_postprocess(out))
            scale = router.output_scale()
            if serving_lora:
                routed = [slot_order_sum(out.reshape(tokens, k, -1)) for out in outputs]
            else:
                arithmetic = probe_combine_arithmetic(self.runtime, self.moe, self.config.hidden_size)
                routed = [slot_order_combine(out.reshape(tokens, k, -1), weights, arithmetic) for out in outputs]
            return [(r * scale if scale != 1.0 else r).to(x.dtype) for r in routed]

        def _local_experts_lora_op(self, shard: int = 0):
            """For an engine serving LoRA: this rank's experts as engine rank ``shard``'s CPU LoRA
            experts compute its share of them, with their adapters if attached
            (:func:`..lora.attach_lora`)."""
            from zero_mismatch_plugin.aligned.expert_parallel import AlignedExpertRowsLoRA

            fc1 = [e.linear_fc1.weight for e in self.experts.local_experts]
            fc2 = [e.linear_fc2.weight for e in self.experts.local_experts]
            experts, first = self._expert_adapters()
            params = [] if experts is None else [p for e in experts for pair in e.values() for p in pair.parameters()]
            return self._aligned_ops.get(
                f"local_experts_lora.{shard}", fc1 + fc2 + params,
                lambda: AlignedExpertRowsLoRA(self.runtime, fc1, fc2, experts,
                                              None if first is None else first.lora_config,
                                              engine_shard=(shard, self.engine_shards)))

        def refresh(self) -> None:
            """Re-derive the experts' and the shared expert gate's engine layouts (the router
            and the shared expert's linears are modules of their own)."""
            if self.expert_parallel:
                if self.runtime.vllm_config.lora_config is None:
                    for shard in range(self.engine_shards):
                        self._local_experts_op(shard).derived.refresh()
                else:
                    for shard in range(self.engine_shards):
                        self._local_experts_lora_op(shard).refresh()
                self._engine_router().derived.refresh()
            else:
                self._experts_op().derived.refresh()
                routed = self._routed_op()
                if routed is not self._experts_op():  # the routed experts' adapter, stacked as vLLM's
                    routed.derived.refresh()
            shared = self._shared_ops()
            if shared is not None and shared[3] is not None:
                shared[3].derived.refresh()

    return AlignedMoELayer
