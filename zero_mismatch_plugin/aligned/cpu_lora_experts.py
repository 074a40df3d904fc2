"""Routed MoE experts that take LoRA updates on CPU, in vLLM's structure (``LoRAExpertsMixin``).

``_C.cpu_fused_moe`` has no point where a LoRA update can enter, so these experts keep plain weights
and compute in torch (:func:`cpu_moe_experts`), the updates added by :func:`add_moe_lora`. The engine
gets them through runtime patches (:mod:`zero_mismatch_plugin.integrations.vllm.cpu_moe_lora`), the
trainer on its own layer (:func:`use_cpu_lora_experts`, :func:`with_torch_moe_lora`). The vLLM fork
patch carries the source of the first three functions, beside the :mod:`.row_invariant` kernels they call.
"""

from __future__ import annotations

import functools

from zero_mismatch_plugin.aligned.row_invariant import row_invariant_linear, row_invariant_sigmoid


def add_moe_lora(y, x, topk_ids, token_lora, lora_a_stacked, lora_b_stacked, topk_weights=None):
    """Add each routed row's LoRA update to the expert outputs ``y`` [T, K, N] in place, on CPU.

    Row (t, k) runs expert e = ``topk_ids[t, k]`` under the adapter in slot l = ``token_lora[t]``
    (l < 0: no adapter, the row is left as it is). ``x`` is the input of the expert linear, one row
    per token ([T, in]: gate/up) or per routed row ([T * K, in]: down). For each output slice i
    (gate, up; or down) ``buf = x A_i[l, e]^T`` and ``y[t, k, slice_i] += buf B_i[l, e]^T``, times
    ``topk_weights[t, k]`` when given (the down projection's update is weighted as its base
    output is): the semantics of vLLM's fused MoE LoRA kernels, whose B carries the adapter
    scaling (folded in at load). Rows are grouped by (adapter, expert) and every product goes
    through :func:`row_invariant_linear`, so a row's bits do not depend on the other rows of the
    step.
    """
    import torch

    tokens, top_k = topk_ids.shape
    rows = tokens * top_k
    num_experts = lora_a_stacked[0].shape[1]
    experts = topk_ids.reshape(-1).long()
    row_token = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
    adapters = token_lora[:tokens].long().index_select(0, row_token)
    x_rows = x.index_select(0, row_token) if x.shape[0] != rows else x
    y_rows = y.view(rows, -1)
    weights = None if topk_weights is None else topk_weights.reshape(-1, 1)
    keys = torch.where(adapters >= 0, adapters * num_experts + experts, -1)
    for key in torch.unique(keys[keys >= 0]).tolist():
        idx = (keys == key).nonzero().squeeze(1)
        adapter, expert = divmod(key, num_experts)
        offset = 0
        for a, b in zip(lora_a_stacked, lora_b_stacked):
            lora_a, lora_b = a[adapter, expert], b[adapter, expert]
            xs = x_rows.index_select(0, idx)[:, : lora_a.shape[-1]].to(lora_a.dtype)
            delta = row_invariant_linear(row_invariant_linear(xs, lora_a), lora_b).to(y.dtype)
            if weights is not None:
                delta = delta * weights.index_select(0, idx).to(y.dtype)
            width = lora_b.shape[0]
            y_rows[idx, offset : offset + width] = y_rows[idx, offset : offset + width] + delta
            offset += width
    return y


def cpu_moe_experts(hidden, w13, w2, topk_weights, topk_ids, add_w13_lora=None, add_w2_lora=None):
    """Routed SwiGLU experts with LoRA hooks, on CPU: ``out[t] = sum_k w[t,k] down_e(h)``, e = ``topk_ids[t, k]``.

    The unquantized experts' computation split at the two points a LoRA update enters (vLLM's
    fused ``_C.cpu_fused_moe`` keeps gate/up, the activation and down in one kernel with no hook
    between them): ``gate_up = x W13_e^T`` for every routed row, then ``add_w13_lora(gate_up
    [T, K, 2I])``; ``h = silu(gate) * up``; ``down = (h W2_e^T) * w[t, k]``, then
    ``add_w2_lora(down [T, K, H], h [T * K, I])``; the K rows of a token summed in slot order
    (fp32). ``w13`` [E, 2I, H] ([gate; up]) and ``w2`` [E, H, I] are the plain (unpacked)
    weights. Rows are grouped by expert, products go through :func:`row_invariant_linear` and the
    sigmoid through :func:`row_invariant_sigmoid`, so a row's bits do not depend on the step's
    other rows: the engine's experts and the trainer call this one function.
    """
    import torch

    tokens, top_k = topk_ids.shape
    rows = tokens * top_k
    width = w13.shape[1] // 2
    experts = topk_ids.reshape(-1).long()
    row_token = torch.arange(tokens, device=hidden.device).repeat_interleave(top_k)
    groups = [(e, (experts == e).nonzero().squeeze(1)) for e in torch.unique(experts).tolist()]
    gate_up = hidden.new_empty(rows, w13.shape[1])
    for e, idx in groups:
        xs = hidden.index_select(0, row_token.index_select(0, idx))
        gate_up[idx] = row_invariant_linear(xs, w13[e])
    if add_w13_lora is not None:
        add_w13_lora(gate_up.view(tokens, top_k, -1))
    gate, up = gate_up[:, :width], gate_up[:, width:]
    h = gate * row_invariant_sigmoid(gate) * up
    down = hidden.new_empty(rows, w2.shape[1])
    for e, idx in groups:
        down[idx] = row_invariant_linear(h.index_select(0, idx), w2[e])
    down = down * topk_weights.reshape(-1, 1).to(down.dtype)
    if add_w2_lora is not None:
        add_w2_lora(down.view(tokens, top_k, -1), h)
    slots = down.view(tokens, top_k, -1)
    out = slots[:, 0].clone()
    for k in range(1, top_k):
        out += slots[:, k]
    return out


def cpu_lora_experts_apply(experts, output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map,
                           apply_router_weight_on_input):
    """``apply()`` of CPU unquantized experts that take LoRA updates (``LoRAExpertsMixin``):
    :func:`cpu_moe_experts` on the plain weights, the gate/up and down updates entering through the
    mixin's ``apply_w13_lora`` / ``apply_w2_lora`` (the punica wrapper's ``add_lora_w13`` /
    ``add_lora_w2``) when ``experts._lora_context`` is set; written into ``output``."""
    if expert_map is not None or apply_router_weight_on_input or experts.w1_bias is not None \
            or experts.w2_bias is not None:
        raise NotImplementedError(
            "CPU MoE LoRA experts: expert parallelism, router weights on the input and expert biases "
            "are not supported; serve this model without enable_lora on CPU"
        )
    lora = experts._lora_context
    add_w13 = add_w2 = None
    if lora is not None:
        num_tokens, top_k = topk_ids.shape
        routing = {}

        def add_w13(y):
            routing["meta"] = experts.apply_w13_lora(
                lora, y=y, x=hidden_states, topk_ids=topk_ids, topk_weights=topk_weights, expert_map=None,
                w1=w1, w2=w2, num_tokens=num_tokens, top_k_num=top_k,
            )

        def add_w2(y, h):
            sorted_ids, expert_ids, padded, token_lora = routing["meta"]
            experts.apply_w2_lora(
                lora, y=y, x=h, topk_weights=topk_weights, sorted_token_ids_lora=sorted_ids,
                expert_ids_lora=expert_ids, num_tokens_post_padded_lora=padded, token_lora_mapping=token_lora,
                num_tokens=num_tokens, w1=w1, w2=w2, top_k_num=top_k,
            )

    output.copy_(cpu_moe_experts(hidden_states, w1, w2, topk_weights, topk_ids, add_w13, add_w2))


@functools.cache
def cpu_lora_experts_class():
    """``CPUUnquantizedLoRAExperts``: vLLM's CPU unquantized experts with ``LoRAExpertsMixin``
    (a class built on first use, so importing this module does not import vLLM)."""
    import torch
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin

    class CPUUnquantizedLoRAExperts(LoRAExpertsMixin, CPUUnquantizedExperts):
        """CPU unquantized SwiGLU experts that take LoRA updates (plain weights, torch GEMMs)."""

        isa = "torch"

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            # No grouped-GEMM alignment: the weights are not packed for _C.cpu_fused_moe.
            return mk.FusedMoEExperts.is_supported_config(
                cls, moe_config, weight_key, activation_key, activation_format
            )

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation == MoEActivation.SILU

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # Plain [E, 2I, H] / [E, H, I] weights: what cpu_moe_experts multiplies.
            self._use_zentorch = False

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            cpu_lora_experts_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map,
                                   apply_router_weight_on_input)

    return CPUUnquantizedLoRAExperts


def use_cpu_lora_experts(quant_method) -> bool:
    """Make an unquantized MoE method built without the selection patch use the LoRA-capable CPU
    experts, before its kernel is built (the trainer's own layer; no process-wide change). Returns
    whether it applies (CPU with LoRA enabled)."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() and quant_method.moe.is_lora_enabled):
        return False
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    quant_method.unquantized_backend, quant_method.experts_cls = UnquantizedMoeBackend.CPU, cpu_lora_experts_class()
    return True


def with_torch_moe_lora(wrapper):
    """``wrapper`` (a punica wrapper object the caller owns) with the torch ``add_lora_w13`` /
    ``add_lora_w2`` of this module bound to it: the trainer's form of the two punica patches."""
    import types

    base = type(wrapper)
    wrapper.add_lora_w13 = types.MethodType(add_lora_w13_in_torch(base.add_lora_w13), wrapper)
    wrapper.add_lora_w2 = types.MethodType(add_lora_w2_in_torch(base.add_lora_w2), wrapper)
    return wrapper


def _token_lora(wrapper, token_lora_mapping, num_tokens):
    return wrapper.token_lora_indices[:num_tokens] if token_lora_mapping is None else token_lora_mapping


def add_lora_w13_in_torch(original):
    """The punica wrapper's ``add_lora_w13`` computed with :func:`add_moe_lora`; ``original`` where that
    does not apply."""

    def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, w1, w2,
                     num_tokens, top_k_num, max_loras, adapter_enabled, local_num_experts, top_k, num_slices,
                     fully_sharded, use_tuned_config, add_inputs=True, token_lora_mapping=None):
        if expert_map is not None or fully_sharded or not add_inputs:
            return original(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, w1,
                            w2, num_tokens, top_k_num, max_loras, adapter_enabled, local_num_experts, top_k,
                            num_slices, fully_sharded, use_tuned_config, add_inputs, token_lora_mapping)
        token_lora = _token_lora(self, token_lora_mapping, num_tokens)
        add_moe_lora(y, x, topk_ids, token_lora, lora_a_stacked, lora_b_stacked)
        # What add_lora_w2 reuses: the experts of every row travel as expert_ids_lora.
        return None, topk_ids, None, token_lora

    return add_lora_w13


def add_lora_w2_in_torch(original):
    """The punica wrapper's ``add_lora_w2`` computed with :func:`add_moe_lora`; ``original`` where that
    does not apply."""

    def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora,
                    expert_ids_lora, num_tokens_post_padded_lora, token_lora_mapping, num_tokens, w1, w2,
                    top_k_num, max_loras, adapter_enabled, top_k, fully_sharded, tp_rank, use_tuned_config,
                    add_inputs=True):
        if sorted_token_ids_lora is not None or fully_sharded or not add_inputs:
            return original(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora,
                            expert_ids_lora, num_tokens_post_padded_lora, token_lora_mapping, num_tokens, w1, w2,
                            top_k_num, max_loras, adapter_enabled, top_k, fully_sharded, tp_rank,
                            use_tuned_config, add_inputs)
        token_lora = _token_lora(self, token_lora_mapping, num_tokens)
        add_moe_lora(y, x, expert_ids_lora, token_lora, lora_a_stacked, lora_b_stacked, topk_weights)

    return add_lora_w2
