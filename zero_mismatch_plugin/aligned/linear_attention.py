"""Gated delta-net linear attention (Qwen3-Next, Qwen3.5) with one arithmetic for prefill, decode
and the trainer.

vLLM's CPU path prefills a sequence with its chunked kernel (``chunk_gated_delta_rule_cpu``) and
decodes it with its recurrent one (``fused_sigmoid_gating_delta_rule_update_cpu``); the two round
differently, so a token's logprob depended on whether it was prefilled or decoded. Here every
token, prefilled, decoded or trained on, goes through the recurrent kernel one position at a time
(that kernel gave a sequence the same bits alone and in a batch of 2 or 8), and the short causal
convolution before it is :func:`fixed_order_causal_conv`, whose taps are summed in one order
whether the previous inputs come from the conv state or from the same call. The engine side is
:func:`consistent_gdn_attention` (put in place by ``integrations.vllm.cpu_gdn`` at run time, by the
fork patch ``vllm/0010`` in source); the trainer side is :class:`AlignedGatedDeltaNet` and
:class:`GatedDeltaRuleFn`. The cost: a prefill of ``T`` tokens is ``T`` kernel calls per layer
instead of one chunked call.

Shapes follow vLLM's layer: ``q``, ``k`` [tokens, key heads, head dim], ``v`` [tokens, value heads,
head dim], ``a``, ``b`` [tokens, value heads]; a value head reads key head ``h // (Hv / Hk)``.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from zero_mismatch_plugin.aligned.ops import observable
from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid


def fixed_order_causal_conv(x, weight, bias, previous=None, activation="silu"):
    """Depthwise causal convolution over time with its taps summed in one fixed order, in fp32:

        x̃ = [previous; x],   y_t = b + Σ_{j=0}^{W-1} w_j ⊙ x̃_{t+j}   (j ascending),
        out_t = y_t · σ(y_t) for ``activation="silu"`` (else y_t), rounded to ``x.dtype``.

    ``x`` [..., T, C]; ``weight`` [C, W]; ``bias`` [C] or None; ``previous`` [..., W-1, C], the
    inputs before ``x`` (None: zeros, a sequence's start). Returns ``(out [..., T, C], new previous
    [..., W-1, C])``; leading dimensions are independent sequences (a decode step's batch).

    Every multiply and add is one IEEE operation on whole [T, C] slices, so ``out_t`` has the same
    bits whether ``x̃_{t+j}`` came from ``previous`` or from ``x``: one token at a time (decode)
    and all at once (prefill, trainer) agree. The sigmoid is :func:`row_invariant_sigmoid` (torch's
    rounds its scalar tail otherwise). Differentiable.
    """
    width, steps = weight.shape[-1], x.shape[-2]
    if previous is None:
        previous = x.new_zeros(*x.shape[:-2], width - 1, x.shape[-1])
    padded = torch.cat([previous.to(x.dtype), x], dim=-2)
    w = weight.float()
    y = padded[..., 0:steps, :].float() * w[:, 0]
    for j in range(1, width):
        y = y + padded[..., j : j + steps, :].float() * w[:, j]
    if bias is not None:
        y = y + bias.float()
    if activation in ("silu", "swish"):
        y = y * row_invariant_sigmoid(y)
    elif activation is not None:
        raise ValueError(f"causal conv activation {activation!r}: expected 'silu', 'swish' or None")
    return y.to(x.dtype), padded[..., steps:, :]


def recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state_pool, slots, seq_lens, out=None):
    """vLLM's CPU recurrent gated delta rule (``fused_sigmoid_gating_delta_rule_update_cpu``,
    gating, q/k L2 norm and 1/sqrt(d) scale fused) applied to packed sequences one position at a
    time: step ``t`` runs the kernel on the ``t``-th token of every sequence longer than ``t``.

    ``seq_lens[i]`` tokens of sequence ``i`` lie contiguously, in order; its recurrent state is
    ``state_pool[slots[i]]`` ([value heads, head dim, head dim], read and updated in place, in the
    pool's dtype as vLLM keeps it). Returns ``out`` [tokens, value heads, head dim] in ``v``'s dtype.
    """
    from vllm import _custom_ops as vllm_ops

    if out is None:
        out = torch.empty_like(v)
    lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    slots = torch.as_tensor(slots, dtype=torch.int32)
    for t in range(int(lens.max()) if len(lens) else 0):
        live = torch.nonzero(lens > t).flatten()
        rows = starts[live] + t
        n = len(live)
        step = vllm_ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=A_log, dt_bias=dt_bias, q=q[rows][None], k=k[rows][None], v=v[rows][None],
            a=a[rows].contiguous(), b=b[rows].contiguous(), initial_state_source=state_pool,
            initial_state_indices=slots[live].contiguous(), cu_seqlens=torch.arange(n + 1, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True,
        )
        out[rows] = step.reshape(n, *out.shape[1:])
    return out


def l2_normalized(x, eps=1e-6):
    """x / sqrt(Σ x² + eps) over the last dimension (the kernels' ``use_qk_l2norm_in_kernel``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _rule_inputs(q, k, v, a, b, A_log, dt_bias):
    """The rule's per-step inputs in ``v``'s dtype, key heads repeated for their value heads:
    (q̂ [T, Hv, D], k̂ [T, Hv, D], g [T, Hv] (the log decay), β [T, Hv])."""
    repeat, dtype = v.shape[1] // q.shape[1], v.dtype
    qn = l2_normalized(q.to(dtype)).repeat_interleave(repeat, dim=1) * q.shape[-1] ** -0.5
    kn = l2_normalized(k.to(dtype)).repeat_interleave(repeat, dim=1)
    g = -torch.exp(A_log.to(dtype)) * torch.nn.functional.softplus(a.to(dtype) + dt_bias.to(dtype))
    return qn, kn, g, torch.sigmoid(b.to(dtype))


def gated_delta_rule_reference(q, k, v, a, b, A_log, dt_bias, initial_state=None):
    """The gated delta rule of one sequence in plain torch, in the inputs' dtype (float64 for
    checks, fp32 for the trainer's backward), differentiable:

        q̂_t = l2norm(q_t) / sqrt(d_k),  k̂_t = l2norm(k_t),
        g_t = -exp(A_log) · softplus(a_t + dt_bias),  β_t = σ(b_t),
        S' = e^{g_t} S_{t-1},   S_t = S' + k̂_t ⊗ β_t (v_t - S'ᵀ k̂_t),   o_t = S_tᵀ q̂_t

    per value head (the gated delta rule of Yang, Kautz and Hatamizadeh, "Gated Delta Networks",
    in the recurrent form vLLM's and transformers' Qwen3-Next references run). ``q``, ``k`` [T, Hk, D];
    ``v`` [T, Hv, Dv]; ``a``, ``b`` [T, Hv]; state [Hv, D, Dv]. Returns (o [T, Hv, Dv], final state).
    """
    qn, kn, g, beta = _rule_inputs(q, k, v, a, b, A_log, dt_bias)
    decay = torch.exp(g)
    state = (torch.zeros(v.shape[1], q.shape[-1], v.shape[-1], dtype=v.dtype) if initial_state is None
             else initial_state.to(v.dtype))
    outputs = []
    for t in range(v.shape[0]):
        state = state * decay[t][:, None, None]
        read = torch.einsum("hk,hkv->hv", kn[t], state)
        delta = (v[t] - read) * beta[t][:, None]
        state = state + kn[t][:, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", qn[t], state))
    return torch.stack(outputs), state


def gated_delta_rule_chunked(q, k, v, a, b, A_log, dt_bias, chunk: int = 64):
    """:func:`gated_delta_rule_reference` (same inputs, same result up to round-off) computed a
    chunk of ``chunk`` positions at a time, so that autograd records T / chunk steps instead of T.

    Within a chunk starting from state S₀, with γ_t = Σ_{s≤t} g_s (cumulative log decay) and the
    step's deltas δ_t = β_t (v_t - S'_tᵀ k̂_t) of the recurrence (S_t = S'_t + k̂_t δ_tᵀ):

        δ_t + β_t Σ_{s<t} e^{γ_t-γ_s} (k̂_t·k̂_s) δ_s = β_t v_t - β_t e^{γ_t} S₀ᵀ k̂_t   (a unit lower-triangular solve)
        o_t = e^{γ_t} S₀ᵀ q̂_t + Σ_{s≤t} e^{γ_t-γ_s} (q̂_t·k̂_s) δ_s
        S_C = e^{γ_C} S₀ + Σ_s e^{γ_C-γ_s} k̂_s δ_sᵀ

    (unrolling S_t = e^{g_t} S_{t-1} + k̂_t δ_tᵀ inside the chunk). Padding past the sequence's end
    has β = 0 and g = 0, so it changes nothing before it. Returns (o [T, Hv, Dv], final state).
    """
    steps, dtype = v.shape[0], v.dtype
    # Heads first: [H, T, ...]
    qn, kn, g, beta = (x.transpose(0, 1) for x in _rule_inputs(q, k, v, a, b, A_log, dt_bias))
    values = v.transpose(0, 1)
    pad = -steps % chunk
    if pad:  # [H, T, ...] padded at the end along T
        qn, kn, values = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (qn, kn, values))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    state = torch.zeros(v.shape[1], q.shape[-1], v.shape[-1], dtype=dtype, device=v.device)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    eye = torch.eye(chunk, dtype=dtype, device=v.device)
    outputs = []
    for start in range(0, steps + pad, chunk):
        part = slice(start, start + chunk)
        qc, kc, vc, bc = qn[:, part], kn[:, part], values[:, part], beta[:, part]
        gamma = g[:, part].cumsum(-1)  # [H, C]
        # e^{γ_t-γ_s} on and below the diagonal (masked before exp: above it the difference is positive)
        decay = torch.exp(torch.where(causal, gamma[:, :, None] - gamma[:, None, :], torch.zeros((), dtype=dtype)))
        decay = decay * causal
        lower = bc[:, :, None] * decay * (kc @ kc.transpose(-1, -2)) * (1 - eye)
        rhs = bc[:, :, None] * (vc - torch.exp(gamma)[:, :, None] * (kc @ state))
        deltas = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        outputs.append(torch.exp(gamma)[:, :, None] * (qc @ state) + (decay * (qc @ kc.transpose(-1, -2))) @ deltas)
        last = gamma[:, -1:]
        state = torch.exp(last)[:, :, None] * state + (kc * torch.exp(last - gamma)[:, :, None]).transpose(-1, -2) @ deltas
    return torch.cat(outputs, dim=1)[:, :steps].transpose(0, 1), state


# ----- The engine side (consistent mode on CPU): integrations.vllm.cpu_gdn, fork patch vllm/0010 -----


def cpu_conv1d_weight(conv1d):
    """The (channels, width) weight of vLLM's conv1d layer, also where vLLM's CPU dispatch
    VNNI-packed it in place (AVX-512-bf16 hosts) and kept the plain copy beside it, and where
    an engine serving LoRA wrapped the layer (conv1d is a ColumnParallelLinear: the plain copy
    is on the wrapped ``base_layer``)."""
    conv1d = getattr(conv1d, "base_layer", conv1d)
    plain = getattr(conv1d, "_cpu_unpacked_conv_weight", None)
    if plain is not None:
        return plain
    weight = conv1d.weight
    return weight.view(weight.size(0), weight.size(-1)) if weight.dim() == 3 else weight


def time_major_conv_states(layer):
    """The layer's conv state as [slots, width - 1, channels] (time-major) over either of vLLM's
    cache layouts (a view: writes reach the cache)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv_states = layer.kv_cache[0]
    return conv_states.transpose(-1, -2) if is_conv_state_dim_first() else conv_states


def scheduled_causal_conv(attn_metadata, conv_states, mixed_qkv, weight, bias, activation):
    """:func:`fixed_order_causal_conv` over one engine step's tokens (vLLM's metadata order:
    decodes first, one token each, then prefills), each sequence continuing from its conv state
    (``conv_states`` time-major, updated in place) unless it starts fresh. Returns (the convolved
    tokens, the slots of the sequences that start fresh: their recurrent state must start at zero)."""
    slots = attn_metadata.non_spec_state_indices_tensor
    starts = attn_metadata.non_spec_query_start_loc
    num_decodes, num_prefills = attn_metadata.num_decodes, attn_metadata.num_prefills
    conv_out = torch.empty_like(mixed_qkv)
    if num_decodes:  # one token each (no speculative tokens on this path)
        decode_slots = slots[:num_decodes].long()
        out, previous = fixed_order_causal_conv(
            mixed_qkv[:num_decodes, None], weight, bias, conv_states[decode_slots], activation)
        conv_out[:num_decodes] = out[:, 0]
        conv_states[decode_slots] = previous.to(conv_states.dtype)
    has_initial_state, fresh_slots = attn_metadata.has_initial_state, []
    for i in range(num_decodes, num_decodes + num_prefills):
        slot, rows = int(slots[i]), slice(int(starts[i]), int(starts[i + 1]))
        fresh = not bool(has_initial_state[i])
        out, previous = fixed_order_causal_conv(
            mixed_qkv[rows], weight, bias, None if fresh else conv_states[slot], activation)
        conv_out[rows] = out
        conv_states[slot] = previous.to(conv_states.dtype)
        if fresh:
            fresh_slots.append(slot)
    return conv_out, fresh_slots


def scheduled_lengths(attn_metadata) -> list[int]:
    """The number of tokens of each sequence in one engine step, in the metadata's order."""
    starts = attn_metadata.non_spec_query_start_loc
    num_seqs = attn_metadata.num_decodes + attn_metadata.num_prefills
    return (starts[1 : num_seqs + 1] - starts[:num_seqs]).tolist()


def consistent_gdn_attention(layer, attn_metadata, mixed_qkv, b, a, core_attn_out) -> None:
    """The core of one gated delta-net layer for a mixed decode + prefill step (vLLM's metadata
    order: decodes first), each token computed as the aligned trainer computes it."""
    num_seqs = attn_metadata.num_decodes + attn_metadata.num_prefills
    num_tokens = attn_metadata.num_decode_tokens + attn_metadata.num_prefill_tokens
    ssm_states = layer.kv_cache[1]  # read as [slots, heads, k_dim, v_dim], as vLLM's CPU path views it
    ssm_states = ssm_states.view(ssm_states.size(0), ssm_states.size(1), ssm_states.size(3), ssm_states.size(2))
    conv_out, fresh_slots = scheduled_causal_conv(
        attn_metadata, time_major_conv_states(layer), mixed_qkv[:num_tokens], cpu_conv1d_weight(layer.conv1d),
        layer.conv1d.bias, layer.activation)
    for slot in fresh_slots:
        ssm_states[slot] = 0
    query, key, value = layer.rearrange_mixed_qkv(conv_out)
    core_attn_out[:num_tokens] = recurrent_gated_delta_rule(
        query[0], key[0], value[0], a[:num_tokens], b[:num_tokens], layer.A_log, layer.dt_bias,
        ssm_states, attn_metadata.non_spec_state_indices_tensor[:num_seqs], scheduled_lengths(attn_metadata),
    )


# ----- The trainer side -----


def convolved_sequences(mixed_qkv, weight, seq_lens):
    """:func:`fixed_order_causal_conv` (SiLU, no bias) over each packed sequence from its start
    (``seq_lens[i]`` tokens of sequence ``i``, contiguous), as the engine convolves a fresh prefill."""
    convolved, start = [], 0
    for n in seq_lens:
        out, _ = fixed_order_causal_conv(mixed_qkv[start:start + n], weight, None, None, "silu")
        convolved.append(out)
        start += n
    return torch.cat(convolved)


class GatedDeltaRuleFn(Function):
    """The trainer's gated delta rule over packed sequences, each from a zero state: forward
    :func:`recurrent_gated_delta_rule` (the engine's kernel and order; state kept in
    ``state_dtype`` as the engine keeps it), backward :func:`gated_delta_rule_chunked` (the
    reference's function, a chunk at a time) recomputed in fp32 per sequence and differentiated.
    ``A_log`` and ``dt_bias`` enter in the dtypes the engine's layer holds them in (their casts from
    the trainer's parameters carry the gradient back)."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, seq_lens, state_dtype):
        ctx.save_for_backward(q, k, v, a, b, A_log, dt_bias)
        ctx.seq_lens = list(seq_lens)
        pool = torch.zeros(len(seq_lens), v.shape[1], q.shape[-1], v.shape[-1], dtype=state_dtype, device=v.device)
        return recurrent_gated_delta_rule(
            q.contiguous(), k.contiguous(), v.contiguous(), a, b, A_log, dt_bias,
            pool, list(range(len(seq_lens))), seq_lens,
        )

    @staticmethod
    def backward(ctx, grad_out):
        grads = recomputed_sequence_gradients(ctx.saved_tensors, ctx.seq_lens, grad_out, torch.float32,
                                              lambda *leaves: gated_delta_rule_chunked(*leaves)[0])
        return (*grads, None, None)


def recomputed_sequence_gradients(saved, seq_lens, grad_out, dtype, recompute, per_row: int = 5):
    """The backward of a linear-attention rule over packed sequences that saved only its inputs:
    per sequence, ``recompute(*leaves)`` (its output) from the saved tensors in ``dtype`` and
    differentiated against that sequence's rows of ``grad_out``. The first ``per_row`` saved
    tensors are per token (cut to the sequence's rows), the rest per layer (their gradients summed
    over the sequences). Returns the gradients in the saved tensors' dtypes."""
    grads = [torch.zeros_like(t, dtype=dtype) for t in saved]
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        # detach(): a cast to the tensor's own dtype is the tensor itself (A_log is the parameter)
        leaves = [t[rows].detach().to(dtype).requires_grad_(True) for t in saved[:per_row]]
        leaves += [t.detach().to(dtype).requires_grad_(True) for t in saved[per_row:]]
        with torch.enable_grad():
            per_leaf = torch.autograd.grad(recompute(*leaves), leaves, grad_out[rows].to(dtype), allow_unused=True)
        for i, g in enumerate(per_leaf[:per_row]):
            grads[i][rows] = g
        for i, g in enumerate(per_leaf[per_row:], start=per_row):
            grads[i] += g
        start += n
    return [g.to(t.dtype) for g, t in zip(grads, saved)]


class AlignedGatedRMSNorm:
    """vLLM's ``RMSNormGated`` (``out = rmsnorm(x) * w * act(z)``) with the trainer's weight
    swapped in; backward: vLLM's own ``forward_static`` recomputed in fp32 and differentiated."""

    def __init__(self, runtime, weight, eps: float, activation: str):
        self.weight, self.eps, self.activation = weight, eps, activation
        self.dtype = runtime.dtype
        self.module = runtime.gated_rms_norm(weight.shape[0], eps, activation)

    def __call__(self, x, z):
        return _GatedRMSNormFn.apply(x, z, self.weight, self)


class _GatedRMSNormFn(Function):
    @staticmethod
    def forward(ctx, x, z, weight, norm: AlignedGatedRMSNorm):
        ctx.save_for_backward(x, z, weight)
        ctx.norm = norm
        norm.module.weight.data = weight.detach().to(norm.dtype)
        return norm.module(x, z)

    @staticmethod
    def backward(ctx, grad_out):
        x, z, weight = ctx.saved_tensors
        norm = ctx.norm
        leaves = [t.detach().float().requires_grad_(True) for t in (x, z, weight)]
        with torch.enable_grad():
            out = norm.module.forward_static(*leaves, norm.eps, torch.float32, group_size=None,
                                             norm_before_gate=True, activation=norm.activation)
            gx, gz, gw = torch.autograd.grad(out, leaves, grad_out.float())
        return gx.to(x.dtype), gz.to(z.dtype), gw.to(weight.dtype), None


class AlignedGatedDeltaNet:
    """The token mixer of one gated delta-net layer between its projections, as vLLM's
    ``QwenGatedDeltaNetAttention.forward_cpu`` runs it in consistent mode: the interleaved
    in_proj_qkvz / in_proj_ba outputs split per key-head group, :func:`fixed_order_causal_conv` over
    each sequence's [q; k; v], the recurrent rule (:class:`GatedDeltaRuleFn`) and the gated norm.

    ``conv_weight`` [C, 1, W], ``A_log``, ``dt_bias``, ``norm_weight``: the layer's trainer
    parameters; ``blocks``: the checkpoint's ``GatedDeltaNetBlocks``."""

    recorded_as = "mixer"  # zmrl bisect's name for the token mixer's output

    def __init__(self, runtime, blocks, conv_weight, A_log, dt_bias, norm_weight, eps: float):
        self.blocks, self.dtype = blocks, runtime.dtype
        self.conv_weight, self.A_log, self.dt_bias = conv_weight, A_log, dt_bias
        self.norm = AlignedGatedRMSNorm(runtime, norm_weight, eps, blocks.output_gate)
        self.state_dtype = runtime.linear_attention_state_dtype()

    def split(self, qkvz, ba):
        """vLLM's ``fix_query_key_value_ordering`` (interleaved layout): q, k [T, Hk, Dk],
        v, z [T, Hv, Dv], b, a [T, Hv]."""
        g, t = self.blocks, qkvz.shape[0]
        per_group = g.num_value_heads // g.num_key_heads
        q, k, v, z = qkvz.view(t, g.num_key_heads, -1).split(
            [g.key_head_dim, g.key_head_dim, per_group * g.value_head_dim, per_group * g.value_head_dim], dim=2)
        b, a = ba.view(t, g.num_key_heads, -1).split([per_group, per_group], dim=2)
        return (q, k, v.reshape(t, -1, g.value_head_dim), z.reshape(t, -1, g.value_head_dim),
                b.reshape(t, g.num_value_heads), a.reshape(t, g.num_value_heads))

    @observable
    def __call__(self, qkvz, ba, seq_lens):
        g = self.blocks
        q, k, v, z, b, a = self.split(qkvz, ba)
        t = qkvz.shape[0]
        mixed_qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        # The engine holds conv1d's and dt_bias's weights in the model dtype and A_log in fp32.
        conv_weight = self.conv_weight.to(self.dtype).view(self.conv_weight.shape[0], -1)
        conv_out = convolved_sequences(mixed_qkv, conv_weight, seq_lens)
        query, key, value = conv_out.split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
        core = GatedDeltaRuleFn.apply(
            query.reshape(t, g.num_key_heads, g.key_head_dim), key.reshape(t, g.num_key_heads, g.key_head_dim),
            value.reshape(t, g.num_value_heads, g.value_head_dim), a.contiguous(), b.contiguous(),
            self.A_log.float(), self.dt_bias.to(self.dtype), list(seq_lens), self.state_dtype,
        )
        return self.norm(core, z).reshape(t, g.value_dim)
