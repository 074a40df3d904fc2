"""Kimi Delta Attention (KDA, Kimi Linear / Kimi K3.1's linear attention) with one arithmetic for the
engine's prefill, its decode and the trainer, on CPU.

vLLM 0.31 runs KDA only through Triton kernels (``chunk_kda_with_fused_gate`` for prefill,
``fused_recurrent_kda_packed_decode`` for decode): there is no CPU path, and by the seed's account
the two round differently on a GPU (a chunked prefill and a token-by-token decode). Here every token, prefilled,
decoded or trained on, goes through :func:`kda_recurrence`: the delta rule with a per-channel decay
one position at a time, in fp32, from torch operations whose bits for a sequence do not depend on
the other sequences of the call (elementwise IEEE operations, transcendental functions through
:func:`row_invariant_elementwise`, sums over one head's channels). The short convolution before it
is the gated delta-net's :func:`fixed_order_causal_conv`. The engine side is
:func:`consistent_kda_attention` (put in place by ``integrations.vllm.cpu_kda``); the trainer side
is :class:`AlignedKimiDeltaAttention`: its forward is the same recurrence, its backward
(:class:`KdaRecurrenceFn`) differentiates :func:`kda_chunked`, the same function a chunk at a time,
recomputed from the saved inputs. The cost: ``T`` small steps per layer for a prefill of ``T``
tokens; the trainer keeps only the mixer's inputs for its backward, not ``T`` states.

Shapes follow vLLM's layer: ``q``, ``k``, ``v`` [tokens, heads, head dim]; the gate input ``raw_g``
[tokens, heads, head dim]; ``raw_beta`` [tokens, heads]; the recurrent state of a sequence
[heads, head dim (value), head dim (key)], as vLLM's KDA kernels index it.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from zero_mismatch_plugin.aligned.linear_attention import (
    convolved_sequences,
    cpu_conv1d_weight,
    recomputed_sequence_gradients,
    scheduled_causal_conv,
    scheduled_lengths,
    time_major_conv_states,
)
from zero_mismatch_plugin.aligned.ops import observable
from zero_mismatch_plugin.aligned.row_invariant import row_invariant_elementwise, row_invariant_sigmoid


def kda_gate(raw_g, A_log, dt_bias, lower_bound=None):
    """The per-channel log decay of KDA (Kimi Linear's fused gate, as vLLM's kernels compute it):

        x = raw_g + dt_bias,
        g = -exp(A_log_h) · softplus(x)             (softplus(x) = x for x > 20)
        g = lower_bound · σ(exp(A_log_h) · x)       (with a gate lower bound, the "safe gate")

    ``raw_g`` [..., H, K] (fp32, or float64); ``A_log`` [H]; ``dt_bias`` [H * K]. Returns g [..., H, K]
    in ``raw_g``'s dtype.
    """
    import torch

    threshold = 20.0  # vLLM's kernels: softplus(x) is x above it
    heads, dim = raw_g.shape[-2], raw_g.shape[-1]
    x = raw_g + dt_bias.to(raw_g.dtype).view(heads, dim)
    a = row_invariant_elementwise(torch.exp, A_log.to(raw_g.dtype))[:, None]
    if lower_bound is not None:
        return lower_bound * row_invariant_sigmoid(a * x)
    # clamp() keeps e^x finite where the branch is not taken (its gradient would be inf * 0 there).
    softplus = row_invariant_elementwise(torch.log1p, row_invariant_elementwise(torch.exp, x.clamp(max=threshold)))
    return -a * torch.where(x > threshold, x, softplus)


def kda_step(state, q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound=None):
    """One position of KDA for ``n`` sequences at once (fp32; each sequence's bits are its own):

        q̂ = q / sqrt(Σ q² + 1e-6) · d^-1/2,   k̂ = k / sqrt(Σ k² + 1e-6),   β = σ(raw_beta),
        S' = S · diag(e^g)   (g = :func:`kda_gate`, one decay per key channel),
        u = β (v - S' k̂),    S_t = S' + u k̂ᵀ,    o = S_t q̂

    per head (the delta rule with a diagonal, channel-wise decay: the Kimi Linear report's KDA; the
    recurrent form of vLLM's ``fused_recurrent_kda`` kernels). ``state`` [n, H, V, K];
    ``q``, ``k`` [n, H, K]; ``v`` [n, H, V]; ``raw_g`` [n, H, K]; ``raw_beta`` [n, H].
    Returns (o [n, H, V], the new state), both fp32 (float64 for a float64 state).
    """
    import torch

    q, k, v = (x.to(state.dtype) for x in (q, k, v))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5  # the kernels' L2 norm eps
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    decay = row_invariant_elementwise(torch.exp, kda_gate(raw_g.to(state.dtype), A_log, dt_bias, lower_bound))
    state = state * decay[:, :, None, :]
    update = (v - (state * k[:, :, None, :]).sum(-1)) * row_invariant_sigmoid(raw_beta.to(state.dtype))[..., None]
    state = state + update[..., None] * k[:, :, None, :]
    return (state * q[:, :, None, :]).sum(-1), state


def kda_recurrence(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, states, seq_lens):
    """:func:`kda_step` over packed sequences one position at a time: step ``t`` runs the ``t``-th
    token of every sequence longer than ``t``. ``seq_lens[i]`` tokens of sequence ``i`` lie
    contiguously, in order, and start from ``states[i]`` [H, V, K]. Functional (differentiable).
    Returns (o [tokens, H, V] in ``v``'s dtype, the final states [sequences, H, V, K] fp32, or
    float64 for float64 states)."""
    import torch

    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    states = states if states.dtype == torch.float64 else states.float()
    outputs, rows_done = [], []
    for t in range(int(lens.max()) if len(lens) else 0):
        live = torch.nonzero(lens > t).flatten()
        rows = starts[live] + t
        out, new = kda_step(states[live], q[rows], k[rows], v[rows], raw_g[rows], raw_beta[rows],
                            A_log, dt_bias, lower_bound)
        states = states.index_copy(0, live, new)
        outputs.append(out)
        rows_done.append(rows)
    if not outputs:
        return v.new_empty(0, *v.shape[1:]), states
    stepped = torch.cat(outputs)  # step-major; every token once
    out = stepped.new_zeros(stepped.shape).index_copy(0, torch.cat(rows_done), stepped)
    return out.to(v.dtype), states


def kda_chunked(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound=None, chunk: int = 16):
    """KDA over one sequence from a zero state, ``chunk`` positions at a time (the algorithm of
    vLLM's chunked prefill kernel, in torch, in the inputs' dtype): the same function as
    :func:`kda_recurrence` up to round-off, for float64 checks and as the negative control of a
    prefill that rounds differently. Within a chunk starting from S₀, with γ_t = Σ_{r≤t} g_r per
    key channel and the step updates u_t of the recurrence (S_t = S₀ e^{γ_t} + Σ_{s≤t} u_s (k̂_s ⊙ e^{γ_t-γ_s})ᵀ):

        u_t + β_t Σ_{s<t} A_ts u_s = β_t (v_t - S₀ (k̂_t ⊙ e^{γ_t})),   A_ts = Σ_c k̂_tc k̂_sc e^{γ_tc-γ_sc}
        o_t = S₀ (q̂_t ⊙ e^{γ_t}) + Σ_{s≤t} (Σ_c q̂_tc k̂_sc e^{γ_tc-γ_sc}) u_s
        S_C = S₀ ⊙ e^{γ_C} + Σ_s u_s (k̂_s ⊙ e^{γ_C-γ_s})ᵀ

    (a unit lower-triangular solve per chunk). Padding past the end has β = 0 and g = 0.
    Shapes as :func:`kda_step` with the token axis first; returns (o [T, H, V], final state [H, V, K]).
    """
    steps, dtype = v.shape[0], v.dtype
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g, beta = kda_gate(raw_g, A_log, dt_bias, lower_bound), torch.sigmoid(raw_beta)
    qn, kn, values, g = (x.transpose(0, 1) for x in (qn, kn, v, g))  # heads first: [H, T, ...]
    beta = beta.transpose(0, 1)
    pad = -steps % chunk
    if pad:
        qn, kn, values, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (qn, kn, values, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    heads = v.shape[1]
    state = torch.zeros(heads, v.shape[-1], q.shape[-1], dtype=dtype, device=v.device)
    on_or_below = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    below = on_or_below.tril(-1)
    eye = torch.eye(chunk, dtype=dtype, device=v.device)
    outputs = []
    for start in range(0, steps + pad, chunk):
        part = slice(start, start + chunk)
        qc, kc, vc, bc, gamma = qn[:, part], kn[:, part], values[:, part], beta[:, part], g[:, part].cumsum(1)
        # e^{γ_t-γ_s} per channel on and below the diagonal (masked before exp: above it the exponent is positive)
        diff = gamma[:, :, None, :] - gamma[:, None, :, :]
        decay = torch.exp(torch.where(on_or_below[None, :, :, None], diff, torch.zeros((), dtype=dtype)))
        decay = decay * on_or_below[None, :, :, None]
        a = torch.einsum("htc,hsc,htsc->hts", kc, kc, decay) * below * bc[:, :, None]
        rhs = bc[:, :, None] * (vc - torch.einsum("hvc,htc->htv", state, kc * torch.exp(gamma)))
        updates = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        reads = torch.einsum("htc,hsc,htsc->hts", qc, kc, decay)
        outputs.append(torch.einsum("hvc,htc->htv", state, qc * torch.exp(gamma)) + reads @ updates)
        last = gamma[:, -1:]
        state = state * torch.exp(last) + torch.einsum("hsv,hsc->hvc", updates, kc * torch.exp(last - gamma))
    return torch.cat(outputs, dim=1)[:, :steps].transpose(0, 1), state


def gated_rms_norm_sigmoid(x, gate, weight, eps):
    """KDA's output norm (vLLM's ``FusedRMSNormGated(activation="sigmoid")``) in fp32, row by row:

        out = x / sqrt(mean(x²) + eps) · w · σ(gate),  rounded to ``x.dtype``.

    ``x``, ``gate`` [..., D]; the sigmoid is :func:`row_invariant_sigmoid`."""
    import torch

    xf = x.float()
    normed = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps) * weight.float()
    return (normed * row_invariant_sigmoid(gate.float())).to(x.dtype)


# ----- The engine side (consistent mode on CPU): integrations.vllm.cpu_kda -----


def consistent_kda_attention(layer, attn_metadata, mixed_qkv, g1, g2, beta, core_attn_out) -> None:
    """``KimiGatedDeltaNetAttention._forward`` for a mixed decode + prefill step (vLLM's metadata
    order: decodes first), each token computed as the aligned trainer computes it: the fixed-order
    conv over q/k/v, :func:`kda_recurrence` from each sequence's state slot, the gated output norm.
    ``g1`` [1, tokens, H, K], ``beta`` [1, tokens, H] as the layer passes them; ``core_attn_out``
    [1, tokens, H, V] is written."""
    num_seqs = attn_metadata.num_decodes + attn_metadata.num_prefills
    num_tokens = attn_metadata.num_decode_tokens + attn_metadata.num_prefill_tokens
    heads, dim = layer.local_num_heads, layer.head_dim
    conv_out, fresh_slots = scheduled_causal_conv(
        attn_metadata, time_major_conv_states(layer), mixed_qkv[:num_tokens], cpu_conv1d_weight(layer.conv1d),
        layer.conv1d.bias, "silu")
    recurrent = layer.kv_cache[1]  # [slots, H, V, K]
    for slot in fresh_slots:
        recurrent[slot] = 0
    slots = attn_metadata.non_spec_state_indices_tensor[:num_seqs].long()
    states = recurrent[slots].float()
    q, k, v = (x.reshape(num_tokens, heads, dim) for x in conv_out.split(heads * dim, dim=-1))
    out, states = kda_recurrence(q, k, v, g1[0, :num_tokens], beta[0, :num_tokens], layer.A_log, layer.dt_bias,
                                 layer.gate_lower_bound, states, scheduled_lengths(attn_metadata))
    recurrent[slots] = states.to(recurrent.dtype)
    core_attn_out[0, :num_tokens] = gated_rms_norm_sigmoid(
        out.to(core_attn_out.dtype), g2[:num_tokens], layer.o_norm.weight, layer.o_norm.eps)


def cpu_kda_forward(layer, attn_metadata, mixed_qkv, g1, g2, beta, core_attn_out) -> None:
    """``KimiGatedDeltaNetAttention._forward`` on CPU in consistent mode: nothing for a step
    without this layer's metadata (profile and warm-up runs), the speculative-decoding path refused
    by name, :func:`consistent_kda_attention` otherwise."""
    metadata = None if attn_metadata is None else attn_metadata.get(layer.prefix)
    if metadata is None:
        return
    if metadata.spec_sequence_masks is not None:
        raise NotImplementedError(
            "consistent numerics on CPU: KDA layers under speculative decoding are not covered (their "
            "draft-token path keeps a wider conv buffer); serve without speculative decoding"
        )
    consistent_kda_attention(layer, metadata, mixed_qkv, g1, g2, beta, core_attn_out)


# ----- The trainer side -----

# Positions per chunk of the backward's recomputation: its per-chunk decay tensor is
# [heads, chunk, chunk, key dim], its graph T / chunk steps.
BACKWARD_CHUNK = 16
# The recomputation's dtype. In fp32 the chunk's decays e^{γ_t-γ_s}, differences of cumulative
# sums, cost the gate's gradients precision (A_log 1.9e-6, dt_bias 9e-7 from float64, where autograd
# through the recurrence was 4.3e-7 / 3.2e-7); in float64 every gradient is as close as the fp32
# inputs allow (5-9e-8), for twice the chunk's temporaries.
BACKWARD_DTYPE = torch.float64


class KdaRecurrenceFn(Function):
    """The trainer's KDA over packed sequences, each from a zero state: forward :func:`kda_recurrence`
    (the engine's order and bits, nothing recorded), backward :func:`kda_chunked` (the same function
    up to round-off, a chunk at a time) recomputed per sequence in ``BACKWARD_DTYPE`` and
    differentiated, as the gated delta-net's :class:`GatedDeltaRuleFn` does in fp32. Autograd
    through the recurrence kept a copy of every sequence's state per position ([sequences, H, V, K]
    x T); this keeps the inputs only. Returns the output [tokens, H, V] in ``v``'s dtype."""

    @staticmethod
    def forward(ctx, q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, seq_lens):
        ctx.save_for_backward(q, k, v, raw_g, raw_beta, A_log, dt_bias)
        ctx.lower_bound, ctx.seq_lens = lower_bound, list(seq_lens)
        states = torch.zeros(len(ctx.seq_lens), v.shape[1], v.shape[2], q.shape[2], device=v.device)
        out, _ = kda_recurrence(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, states, ctx.seq_lens)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = recomputed_sequence_gradients(
            ctx.saved_tensors, ctx.seq_lens, grad_out, BACKWARD_DTYPE,
            lambda *leaves: kda_chunked(*leaves, ctx.lower_bound, BACKWARD_CHUNK)[0])
        return (*grads, None, None)


class AlignedKimiDeltaAttention:
    """The token mixer of one KDA layer between its projections, as the engine runs it in
    consistent mode: the q/k/v conv over each packed sequence from a zero state,
    :func:`kda_recurrence` from zero states and the gated output norm. Backward: autograd through
    the conv and the norm, :class:`KdaRecurrenceFn` for the recurrence (fp32 throughout; the
    engine's arithmetic is torch's here, not a kernel's).

    ``conv_weights``: q's, k's and v's [H · K, 1, W]; ``A_log`` [H], ``dt_bias`` [H · K],
    ``norm_weight`` [K]: the layer's trainer parameters; ``blocks``: the checkpoint's
    ``KimiDeltaAttentionBlocks``."""

    recorded_as = "mixer"  # zmrl bisect's name for the token mixer's output

    def __init__(self, runtime, blocks, conv_weights, A_log, dt_bias, norm_weight):
        self.blocks, self.dtype = blocks, runtime.dtype
        self.conv_weights, self.A_log, self.dt_bias, self.norm_weight = list(conv_weights), A_log, dt_bias, norm_weight

    @observable
    def __call__(self, mixed_qkv, g1, g2, raw_beta, seq_lens):
        """``mixed_qkv`` [T, 3 · H · K]; ``g1``, ``g2`` [T, H · K]; ``raw_beta`` [T, H] (the
        projections' outputs in the model dtype). Returns the normed core [T, H · K]."""
        b, t = self.blocks, mixed_qkv.shape[0]
        # The engine stacks q's, k's and v's conv weights and holds them in fp32 whatever the model dtype.
        weight = torch.cat([w.float().reshape(w.shape[0], -1) for w in self.conv_weights])
        convolved = convolved_sequences(mixed_qkv, weight, seq_lens)
        q, k, v = (x.reshape(t, b.num_heads, b.head_dim) for x in convolved.split(b.projection_size, dim=-1))
        core = KdaRecurrenceFn.apply(q, k, v, g1.reshape(t, b.num_heads, b.head_dim), raw_beta,
                                     self.A_log.float(), self.dt_bias.float(), b.gate_lower_bound, seq_lens)
        gate = g2.reshape(t, b.num_heads, b.head_dim)
        return gated_rms_norm_sigmoid(core.to(self.dtype), gate, self.norm_weight.to(self.dtype), b.norm_eps).reshape(t, -1)
