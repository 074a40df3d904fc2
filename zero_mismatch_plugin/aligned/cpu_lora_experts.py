"""Routed MoE experts that take LoRA updates on CPU, in vLLM's structure (``LoRAExpertsMixin``).

``_C.cpu_fused_moe`` has no point where a LoRA update can enter, so these experts compute in
pieces (:func:`cpu_moe_experts`): each expert's GEMMs through vLLM's own CPU linear dispatch, the
kernels and row padding of the model's dense layers (:func:`packed_cpu_linear`, packed once per
weights load), the updates added by :func:`add_moe_lora`. The engine gets them through runtime
patches (:mod:`zero_mismatch_plugin.integrations.vllm.cpu_moe_lora`), the trainer on its own layer
(:func:`use_cpu_lora_experts`, :func:`with_torch_moe_lora`). The vLLM fork patch carries the source
of the first functions of this module, beside the :mod:`.row_invariant` kernel they call.
"""

from __future__ import annotations

import functools

from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid


def packed_cpu_linear(weight):
    """``x -> x @ weight^T`` for a 2-D ``weight`` [out, in], packed once now through vLLM's CPU
    linear dispatch (``dispatch_cpu_unquantized_gemm``): the kernel vLLM's dense layers get for
    that shape and dtype (oneDNN, or the sgl-kernel), with the row padding the plugin's consistent
    mode adds to it, so a row's bits do not depend on the call's other rows, as for the dense
    layers (docs/hosts.md; the trainer's probe checks the shapes). Packing costs about as much as
    the GEMM of a few hundred rows, so callers keep the result for as long as the weight holds; a
    later write to ``weight`` is not seen by it.
    """
    import torch
    from vllm.model_executor.layers import utils

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    utils.dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
    cpu_linear, kept = holder.cpu_linear, holder.weight  # kept: the weight itself only where unpacked

    def linear(x):
        return cpu_linear(x, kept, None)

    return linear


def lora_linears(stacked, adapter, expert):
    """:func:`packed_cpu_linear` of ``stacked[adapter, expert]`` (a LoRA A or B buffer [slots,
    experts, rows, cols]), packed on first use and kept on the buffer until it is written to
    again (an adapter loaded into a slot: ``torch.Tensor._version`` counts the writes)."""
    cache = getattr(stacked, "_packed_linears", None)
    if cache is None or cache[0] != stacked._version:
        cache = (stacked._version, {})
        stacked._packed_linears = cache
    key = (adapter, expert)
    if key not in cache[1]:
        cache[1][key] = packed_cpu_linear(stacked[adapter, expert])
    return cache[1][key]


def expert_linears(w13, w2):
    """(gate/up, down) :func:`packed_cpu_linear` of every expert of ``w13`` [E, 2I, H] and ``w2``
    [E, H, I]."""
    return [packed_cpu_linear(w) for w in w13], [packed_cpu_linear(w) for w in w2]


def add_moe_lora(y, x, topk_ids, token_lora, lora_a_stacked, lora_b_stacked, topk_weights=None):
    """Add each routed row's LoRA update to the expert outputs ``y`` [T, K, N] in place, on CPU.

    Row (t, k) runs expert e = ``topk_ids[t, k]`` under the adapter in slot l = ``token_lora[t]``
    (l < 0: no adapter, the row is left as it is). ``x`` is the input of the expert linear, one row
    per token ([T, in]: gate/up) or per routed row ([T * K, in]: down). For each output slice i
    (gate, up; or down) ``buf = x A_i[l, e]^T`` and ``y[t, k, slice_i] += buf B_i[l, e]^T``, times
    ``topk_weights[t, k]`` when given (the down projection's update is weighted as its base
    output is): the semantics of vLLM's fused MoE LoRA kernels, whose B carries the adapter
    scaling (folded in at load). Rows are grouped by (adapter, expert) and every product goes
    through the packed GEMMs of :func:`lora_linears`, so a row's bits do not depend on the other
    rows of the step.
    """
    import torch

    tokens, top_k = topk_ids.shape
    rows = tokens * top_k
    num_experts = lora_a_stacked[0].shape[1]
    adapters = token_lora[:tokens].long().repeat_interleave(top_k)
    keys = torch.where(adapters >= 0, adapters * num_experts + topk_ids.reshape(-1).long(), -1)
    # Rows sorted by (adapter, expert), stable; the rows without adapter (key -1) come first, dropped.
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys.index_select(0, order)
    without = int((sorted_keys < 0).sum())
    order, sorted_keys = order[without:], sorted_keys[without:]
    if order.numel() == 0:
        return y
    groups, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    groups = [divmod(key, num_experts) for key in groups.tolist()]
    counts = counts.tolist()
    y_rows = y.view(rows, -1)
    in_place = order.numel() == rows and bool((order == torch.arange(rows, device=order.device)).all())
    if in_place:  # the rows come grouped already (the CPU experts hand them over so): no copies
        x_sorted = x if x.shape[0] == rows else x.repeat_interleave(top_k, dim=0)
        weights = None if topk_weights is None else topk_weights.reshape(-1, 1).to(y.dtype)
        y_sorted = y_rows
    else:
        x_sorted = x.index_select(0, order if x.shape[0] == rows else order.div(top_k, rounding_mode="floor"))
        weights = None if topk_weights is None else topk_weights.reshape(-1, 1).index_select(0, order).to(y.dtype)
        y_sorted = y_rows.index_select(0, order)
    offset = 0
    for a, b in zip(lora_a_stacked, lora_b_stacked):
        xs = x_sorted[:, : a.shape[-1]].to(a.dtype)
        width, start = b.shape[-2], 0
        for (adapter, expert), count in zip(groups, counts):
            delta = lora_linears(b, adapter, expert)(lora_linears(a, adapter, expert)(xs[start : start + count]))
            delta = delta.to(y.dtype)
            if weights is not None:
                delta = delta * weights[start : start + count]
            y_sorted[start : start + count, offset : offset + width] += delta
            start += count
        offset += width
    if not in_place:
        y_rows.index_copy_(0, order, y_sorted)
    return y


def cpu_moe_experts(hidden, w13, w2, topk_weights, topk_ids, add_w13_lora=None, add_w2_lora=None, linears=None,
                    capture_gate_up=None):
    """Routed SwiGLU experts with LoRA hooks, on CPU: ``out[t] = sum_k w[t,k] down_e(h)``, e = ``topk_ids[t, k]``.

    The unquantized experts' computation split at the two points a LoRA update enters (vLLM's
    fused ``_C.cpu_fused_moe`` keeps gate/up, the activation and down in one kernel with no hook
    between them). The routed (token, slot) rows are sorted by expert once (stable), and each
    expert's rows go through its steps in turn, while they are in cache: ``gate_up = x W13_e^T``,
    then ``add_w13_lora(y=gate_up, x=x, ...)``; ``h = silu(gate) * up``; ``down = (h W2_e^T) * w``,
    then ``add_w2_lora(y=down, x=h, ...)``. Each hook gets the expert's rows as tokens of top-k 1
    (``y`` [n, 1, N], ``x`` [n, in], ``ids`` and ``weights`` [n, 1]) and ``order`` (row i is routed
    row ``order[i]`` of ``topk_ids.reshape(-1)``) to map its tokens' adapters onto them. Then the K
    rows of a token are summed in slot order (fp32). ``w13`` [E, 2I, H] ([gate; up]) and ``w2``
    [E, H, I] are the plain (unpacked) weights; ``linears``: their :func:`expert_linears` where the
    caller keeps them (packed here otherwise). Each expert's rows are one call of its packed GEMM and
    the sigmoid is :func:`row_invariant_sigmoid`, so a row's bits do not depend on the step's other
    rows: the engine's experts and the trainer call this one function. ``capture_gate_up`` (a
    trainer's hook) receives each expert's gate/up pre-activations, updates included, in expert
    order, for a backward that need not recompute them.
    """
    import torch

    tokens, top_k = topk_ids.shape
    width = w13.shape[1] // 2
    gate_up_linears, down_linears = expert_linears(w13, w2) if linears is None else linears
    experts = topk_ids.reshape(-1).long()
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=len(gate_up_linears)).tolist()
    ids = experts.index_select(0, order).view(-1, 1).to(topk_ids.dtype)
    weights = topk_weights.reshape(-1).index_select(0, order).view(-1, 1)
    x = hidden.index_select(0, order.div(top_k, rounding_mode="floor"))

    def expert_rows(e, rows):
        block = {name: t[rows] for name, t in (("ids", ids), ("weights", weights), ("order", order))}
        gate_up = gate_up_linears[e](x[rows])
        if add_w13_lora is not None:
            add_w13_lora(y=gate_up.view(-1, 1, w13.shape[1]), x=x[rows], **block)
        if capture_gate_up is not None:
            capture_gate_up(gate_up)
        gate, up = gate_up[:, :width], gate_up[:, width:]
        h = row_invariant_sigmoid(gate).mul_(gate).mul_(up)  # silu(gate) * up
        down = down_linears[e](h)
        down.mul_(block["weights"].to(down.dtype))
        if add_w2_lora is not None:
            add_w2_lora(y=down.view(-1, 1, w2.shape[1]), x=h, **block)
        return down

    blocks, start = [], 0
    for e, n in enumerate(counts):
        if n:
            blocks.append(expert_rows(e, slice(start, start + n)))
        start += n
    down = hidden.new_empty(0, w2.shape[1]) if not blocks else blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    # Slot k of token t is sorted row restore[t * K + k]; the slots are added in slot order.
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    slot_rows = restore.view(tokens, top_k)
    out = down.index_select(0, slot_rows[:, 0])
    for k in range(1, top_k):
        out += down.index_select(0, slot_rows[:, k])
    return out


def cpu_lora_experts_apply(experts, output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map,
                           apply_router_weight_on_input):
    """``apply()`` of CPU unquantized experts that take LoRA updates (``LoRAExpertsMixin``):
    :func:`cpu_moe_experts` on the plain weights, the gate/up and down updates entering through the
    mixin's ``apply_w13_lora`` / ``apply_w2_lora`` (the punica wrapper's ``add_lora_w13`` /
    ``add_lora_w2``) when ``experts._lora_context`` is set, on the rows sorted by expert as tokens
    of top-k 1 with their adapters as a dispatched (per-row) token mapping, as after an
    expert-parallel dispatch; written into ``output``. A trainer may set
    ``experts._capture_gate_up`` (see :func:`cpu_moe_experts`)."""
    import dataclasses

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
        token_lora = lora.local_token_lora_mapping
        if token_lora is None:
            token_lora = lora.punica_wrapper.token_lora_indices[:num_tokens]
        routing = {}

        def add_w13(y, x, ids, weights, order):
            row_lora = token_lora[:num_tokens].repeat_interleave(top_k).index_select(0, order)
            routing["lora"] = dataclasses.replace(lora, local_token_lora_mapping=row_lora)
            routing["meta"] = experts.apply_w13_lora(
                routing["lora"], y=y, x=x, topk_ids=ids, topk_weights=weights, expert_map=None,
                w1=w1, w2=w2, num_tokens=y.shape[0], top_k_num=1,
            )

        def add_w2(y, x, ids, weights, order):
            sorted_ids, expert_ids, padded, row_lora = routing["meta"]
            experts.apply_w2_lora(
                routing["lora"], y=y, x=x, topk_weights=weights, sorted_token_ids_lora=sorted_ids,
                expert_ids_lora=expert_ids, num_tokens_post_padded_lora=padded, token_lora_mapping=row_lora,
                num_tokens=y.shape[0], w1=w1, w2=w2, top_k_num=1,
            )

    packed = getattr(experts, "_expert_linears", None)
    linears = packed[1] if packed is not None and packed[0] == (w1.data_ptr(), w2.data_ptr()) else None
    capture = getattr(experts, "_capture_gate_up", None)
    output.copy_(cpu_moe_experts(hidden_states, w1, w2, topk_weights, topk_ids, add_w13, add_w2, linears, capture))


def pack_cpu_lora_experts(experts, layer):
    """``process_weights_after_loading`` of the CPU LoRA experts: every expert's GEMMs packed once
    (:func:`expert_linears`) from the layer's plain weights, kept with their addresses so
    :func:`cpu_lora_experts_apply` uses them only on those weights. vLLM runs it after each load
    (a weight update too, see ``reprocess_moe_as_first_load``)."""
    experts._use_zentorch = False
    w13, w2 = layer.w13_weight, layer.w2_weight
    experts._expert_linears = ((w13.data_ptr(), w2.data_ptr()), expert_linears(w13, w2))


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
            # Plain [E, 2I, H] / [E, H, I] weights stay (the LoRA updates and the trainer's
            # backward read them); each expert's GEMMs are packed beside them.
            pack_cpu_lora_experts(self, layer)

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
