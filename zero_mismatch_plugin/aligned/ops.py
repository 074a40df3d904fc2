"""Autograd ops whose forward is vLLM's kernel and whose backward is the analytic gradient.

Each forward calls a vLLM layer instance (see :mod:`.runtime`) on the same inputs, in the same
order and layout, as vLLM's model code does, so its output bits are the engine's. vLLM's kernels
are forward-only; the backward of each op is written here in plain torch, in fp32 (a bf16 engine's
GEMMs in bf16 with fp32 accumulation, as autocast runs them, and its SwiGLU in bf16, as
transformers' bf16 autograd forms it).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd import Function

from zero_mismatch_plugin.aligned.cpu_gemm import fp32_gemm_for
from zero_mismatch_plugin.aligned.derived import DerivedWeight, cast_like_engine
from zero_mismatch_plugin.aligned.runtime import KernelLayer, VllmRuntime


# ----- The hook point for inspection (``zmrl bisect``) ------------------------------------

_observer = None


@contextlib.contextmanager
def observed(observer):
    """Inside, every aligned op call runs as ``observer(op, run, args)``, which returns ``run(*args)``
    (it may record, or change inputs or outputs): how the bisect recorder sees every face's ops."""
    global _observer
    previous, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = previous


def observing() -> bool:
    """An observer is set: a face may then expose a value it computes only for inspection."""
    return _observer is not None


def observable(call):
    @functools.wraps(call)
    def observable_call(self, *args):
        if _observer is None:
            return call(self, *args)
        return _observer(self, lambda *a: call(self, *a), args)

    return observable_call


def _norm_backward(x32, w32, g32, eps):
    """d/dx and d/dw of y = x * rsqrt(mean(x^2) + eps) * w over the last dim (fp32)."""
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x32 * r
    gw = g32 * w32 if w32 is not None else g32
    gx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    gweight = None
    if w32 is not None:
        gweight = (g32 * xhat).reshape(-1, x32.shape[-1]).sum(0)
    return gx, gweight


# ----- RMSNorm -----------------------------------------------------------------------------


class AlignedRMSNorm:
    """vLLM ``RMSNorm`` (plain and fused residual-add) with the trainer's weight swapped in;
    ``gemma``: vLLM's ``GemmaRMSNorm``, whose scale is ``1 + weight``."""

    def __init__(self, runtime: VllmRuntime, weight: torch.nn.Parameter, eps: float, gemma: bool = False):
        self.weight = weight
        self.eps = eps
        self.scale_offset = 1.0 if gemma else 0.0  # the scale is weight + scale_offset
        self.module = runtime.rms_norm(weight.shape[0], eps, gemma=gemma)
        self.engine_weight = DerivedWeight([weight], lambda s: cast_like_engine(s[0], runtime.dtype))

    def kernel(self, x, residual=None):
        self.module.weight.data = self.engine_weight.get()
        if residual is None:
            return self.module(x)
        # vLLM may update x and residual in place (fused kernels); keep autograd's copies intact.
        return self.module(x.clone(), residual.clone())

    @observable
    def __call__(self, x, residual=None):
        if residual is None:
            return _RMSNormFn.apply(x, self.weight, self)
        return _FusedAddRMSNormFn.apply(x, residual, self.weight, self)


class _RMSNormFn(Function):
    @staticmethod
    def forward(ctx, x, weight, norm: AlignedRMSNorm):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.scale_offset = norm.eps, norm.scale_offset
        return norm.kernel(x)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx, gw = _norm_backward(x.float(), weight.float() + ctx.scale_offset, g.float(), ctx.eps)
        return gx.to(x.dtype), gw.to(weight.dtype), None


class _FusedAddRMSNormFn(Function):
    """(x, residual) -> (norm(x + residual), x + residual), as vLLM's fused_add_rms_norm."""

    @staticmethod
    def forward(ctx, x, residual, weight, norm: AlignedRMSNorm):
        out, new_residual = norm.kernel(x, residual)
        ctx.save_for_backward(x, residual, weight)
        ctx.eps, ctx.scale_offset = norm.eps, norm.scale_offset
        return out, new_residual

    @staticmethod
    def backward(ctx, g_out, g_residual):
        x, residual, weight = ctx.saved_tensors
        s = x.to(torch.float32, copy=True).add_(residual)
        gs, gw = _norm_backward(s, weight.float() + ctx.scale_offset, g_out.float(), ctx.eps)
        if g_residual is not None:
            gs.add_(g_residual)
        # x and residual share one gradient (the sum's): rounded once where their dtypes agree.
        gx = gs.to(x.dtype)
        return gx, gx if residual.dtype == x.dtype else gs.to(residual.dtype), gw.to(weight.dtype), None


# ----- Rotary embedding --------------------------------------------------------------------


class AlignedRotary:
    """vLLM's rotary embedding (in-place kernel) applied to copies of q and k."""

    def __init__(self, runtime: VllmRuntime, head_dim: int, max_position: int, rope_parameters,
                 is_neox_style: bool = True):
        self.module = runtime.rotary(head_dim, max_position, rope_parameters, is_neox_style)
        self.head_dim = head_dim
        self.rotary_dim = self.module.rotary_dim
        self.is_neox_style = self.module.is_neox_style

    @observable
    def __call__(self, positions, q, k):
        return _RotaryFn.apply(positions, q, k, self)

    def rotate_back(self, positions, g, inverse: bool):
        """Apply the rotation (or its inverse) to g: [T, heads*D] or [T, heads, D], in fp32."""
        cos_sin = self.module.cos_sin_cache.index_select(0, positions).float()
        cos, sin = cos_sin.chunk(2, dim=-1)
        if inverse:
            sin = -sin
        t, shape = g.shape[0], g.shape
        g = g.float().reshape(t, -1, self.head_dim)
        rot, rest = g[..., : self.rotary_dim], g[..., self.rotary_dim :]
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1).reshape(shape)


class _RotaryFn(Function):
    @staticmethod
    def forward(ctx, positions, q, k, rotary: AlignedRotary):
        q_out = q.clone()
        k_out = k.clone()
        # Most of vLLM's rotaries turn q/k in place; some (DeepSeek's yarn scaling) return new tensors.
        q_out, k_out = rotary.module(positions, q_out, k_out)
        ctx.save_for_backward(positions)
        ctx.rotary = rotary
        return q_out, k_out

    @staticmethod
    def backward(ctx, gq, gk):
        (positions,) = ctx.saved_tensors
        rotary = ctx.rotary
        # The rotation is orthogonal: its transpose is the rotation by -angle.
        gq_in = rotary.rotate_back(positions, gq, inverse=True).to(gq.dtype)
        gk_in = rotary.rotate_back(positions, gk, inverse=True).to(gk.dtype)
        return None, gq_in, gk_in, None


# ----- SwiGLU activation -------------------------------------------------------------------


class AlignedSiluAndMul:
    def __init__(self, runtime: VllmRuntime):
        self.module = runtime.silu_and_mul()

    @observable
    def __call__(self, x):
        return _SiluAndMulFn.apply(x, self)


class _SiluAndMulFn(Function):
    @staticmethod
    def forward(ctx, x, act: AlignedSiluAndMul):
        ctx.save_for_backward(x)
        return act.module(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        d = x.shape[-1] // 2
        a, b = x[..., :d], x[..., d:]
        g = g.to(x.dtype)
        # d/da silu(a) * b = g * b * s * (1 + a * (1 - s)) (aten's silu_backward), d/db = g * silu(a);
        # written into the two halves of one buffer. In the activations' dtype: fp32 for an fp32
        # engine; for a bf16 engine the products transformers' bf16 autograd forms for silu(a) * b
        # (aten's silu_backward computes each element in fp32), without widening four [T, d] tensors.
        grad = torch.empty_like(x)
        torch.ops.aten.silu_backward(g * b, a, grad_input=grad[..., :d])
        torch.mul(g, torch.nn.functional.silu(a), out=grad[..., d:])
        return grad, None


# ----- Linear layers (merged layouts, pre-packed on CPU) -----------------------------------


class AlignedLinear:
    """A vLLM unquantized linear over the concatenation of trainer weight matrices.

    ``weights`` are stacked along the output dim the way vLLM merges q/k/v or gate/up. The merged,
    engine-dtype copy and vLLM's post-load processing of it (oneDNN packing on CPU) are derived
    from the trainer parameters and redone after they change. ``engine_rows`` is for a trainer
    that stacks the rows in another order (megatron's grouped qkv): ``engine_rows[i]`` is the
    trainer row computing vLLM's output ``i``. The GEMM then runs in vLLM's row order and its
    output (and every gradient) is in the trainer's order: a permutation, exact.
    """

    def __init__(self, runtime: VllmRuntime, weights, biases=None, engine_rows=None):
        self.runtime = runtime
        self.weights = list(weights)
        self.biases = list(biases) if biases is not None else [None] * len(self.weights)
        self.has_bias = any(b is not None for b in self.biases)
        if self.has_bias and any(b is None for b in self.biases):
            raise ValueError("either all or none of the merged parts carry a bias")
        self.out_sizes = [w.shape[0] for w in self.weights]
        self.engine_rows = engine_rows
        self.trainer_cols = None
        if engine_rows is not None:
            self.trainer_cols = torch.empty_like(engine_rows)
            self.trainer_cols[engine_rows] = torch.arange(engine_rows.numel(), device=engine_rows.device)
        self.method = runtime.linear_method()
        self.params = self.weights + ([b for b in self.biases] if self.has_bias else [])
        self.derived = DerivedWeight(self.params, self._build, copies=True)  # concatenated, then cloned

    def _build(self, sources):
        """(vLLM's layer, the merged weight in the trainer's row order and the engine dtype)."""
        n = len(self.weights)
        dtype = self.runtime.dtype
        trainer_weight = cast_like_engine(torch.cat(sources[:n], dim=0), dtype).contiguous()
        weight = trainer_weight
        bias = cast_like_engine(torch.cat(sources[n:], dim=0), dtype) if self.has_bias else None
        if self.engine_rows is not None:
            rows = self.engine_rows.to(weight.device)
            weight = weight.index_select(0, rows)
            bias = None if bias is None else bias.index_select(0, rows)
        layer = KernelLayer(weight.clone(), None if bias is None else bias.clone(), self.method)
        with self.runtime.context():
            self.method.process_weights_after_loading(layer)
        return layer, trainer_weight

    def kernel(self, x):
        layer, _ = self.derived.get()
        out = self.method.apply(layer, x, layer.bias)
        if self.trainer_cols is not None:
            out = out.index_select(-1, self.trainer_cols.to(out.device))
        return out

    @observable
    def __call__(self, x):
        return _LinearFn.apply(x, self, *self.params)


class _LinearFn(Function):
    @staticmethod
    def forward(ctx, x, linear: AlignedLinear, *params):
        out = linear.kernel(x)
        _, weight = linear.derived.get()
        ctx.save_for_backward(x, weight)
        ctx.linear = linear
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        linear = ctx.linear
        # In the engine's dtype: fp32 GEMMs for an fp32 engine; bf16 GEMMs (fp32 accumulation, as
        # autocast runs them) when the activations, their gradient and the weight are all bf16, as
        # fp32 GEMMs on a host where the forward's are (no bf16 instructions: faster, and exact products).
        dtype = torch.promote_types(torch.promote_types(g.dtype, x.dtype), weight.dtype)
        if fp32_gemm_for(dtype):
            dtype = torch.float32
        g2 = g.reshape(-1, g.shape[-1]).to(dtype)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        gx = (g2 @ weight.to(dtype)).reshape(x.shape).to(x.dtype)
        gw = (g2.t() @ x2).float().split(linear.out_sizes, dim=0)
        grads = [gwi.to(w.dtype) for gwi, w in zip(gw, linear.weights)]
        if linear.has_bias:
            gb = g2.float().sum(0).split(linear.out_sizes)
            grads += [gbi.to(b.dtype) for gbi, b in zip(gb, linear.biases)]
        return (gx, None, *grads)


# ----- lm_head + LogitsProcessor -----------------------------------------------------------


class AlignedLogits:
    """vLLM's ``LogitsProcessor`` over a padded lm_head (head dtype honoured, vocab sliced)."""

    def __init__(self, runtime: VllmRuntime, weight: torch.nn.Parameter, vocab_size: int, *,
                 padded_vocab: int | None = None, full_vocab: int | None = None):
        """``padded_vocab`` / ``full_vocab``: for one tensor-parallel rank's shard of the head, the
        rows that rank's GEMM has (vLLM pads the whole vocabulary, not each shard) and the whole
        vocabulary (the processor's slice keeps all of the shard's columns)."""
        self.runtime = runtime
        self.weight = weight
        self.vocab_size = vocab_size
        self.padded_vocab = runtime.padded_vocab_size(vocab_size) if padded_vocab is None else padded_vocab
        self.method = runtime.embedding_method()
        self.processor = runtime.logits_processor(full_vocab or vocab_size)
        self.derived = DerivedWeight([weight], self._build, copies=True)  # a padded copy

    def _build(self, sources):
        w = cast_like_engine(sources[0], self.runtime.dtype)
        padded = torch.zeros(self.padded_vocab, w.shape[1], dtype=w.dtype, device=w.device)
        padded[: w.shape[0]] = w
        layer = KernelLayer(padded, None, self.method)
        with self.runtime.context():
            self.method.process_weights_after_loading(layer)
        return layer

    def kernel(self, hidden):
        return self.processor(self.derived.get(), hidden)

    @observable
    def __call__(self, hidden):
        return _LogitsFn.apply(hidden, self.weight, self)


class _LogitsFn(Function):
    @staticmethod
    def forward(ctx, hidden, weight, head: AlignedLogits):
        ctx.save_for_backward(hidden, weight)
        ctx.head = head
        return head.kernel(hidden)

    @staticmethod
    def backward(ctx, g):
        hidden, weight = ctx.saved_tensors
        if ctx.head.processor.soft_cap is not None or ctx.head.processor.scale != 1.0:
            raise NotImplementedError("logit soft-capping / scaling has no aligned backward yet")
        # The GEMMs in the dtype of the forward's operands, as autocast runs a GEMM's backward: fp32
        # for an fp32 engine; for a bf16 one bf16 (fp32 accumulation), though its consistent-mode
        # head computes the logits in fp32 (for their bits, not for the gradient's precision).
        engine_dtype = ctx.head.runtime.dtype
        dtype = torch.promote_types(hidden.dtype, engine_dtype)
        g_ = g.to(dtype)
        w_ = cast_like_engine(weight.detach(), engine_dtype).to(dtype)
        gh = (g_ @ w_).to(hidden.dtype)
        gw = (g_.t() @ hidden.to(dtype)).to(weight.dtype)
        return gh, gw, None


# ----- Attention ---------------------------------------------------------------------------


class AlignedAttention:
    """vLLM's attention backend over packed causal sequences; analytic backward in torch."""

    def __init__(self, runtime: VllmRuntime, num_heads, num_kv_heads, head_dim, scale, sliding_window=None):
        """``sliding_window``: the layer's window as vLLM counts it (each query sees itself and
        the ``sliding_window - 1`` keys before it), ``None`` for full causal attention."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
        self.kernel = runtime.attention(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def plan(self, seq_lens: list[int]):
        """The backend's metadata for one batch: build it once per forward. It is not only a
        function of the lengths (vLLM's CPU backend records the thread count in it, for one)."""
        return self.kernel.metadata(seq_lens)

    @observable
    def __call__(self, q, k, v, plan, seq_lens):
        return _AttentionFn.apply(q, k, v, self, plan, seq_lens)


def masked_positions(n: int, sliding_window: int | None, device=None) -> torch.Tensor:
    """[n, n] bool, True where query i may NOT attend key j: the future (j > i) and, with a
    window, keys ``sliding_window`` or more tokens back (i - j >= sliding_window)."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    masked = j > i
    if sliding_window is not None:
        masked |= (i - j) >= sliding_window
    return masked


def attention_backward(q, k, v, g, seq_lens, num_heads, num_kv_heads, head_dim, scale, sliding_window=None):
    """Gradients of causal (optionally sliding-window) softmax attention per packed sequence, in fp32:
    torch's scaled-dot-product attention recomputed on each sequence and differentiated (its fused
    CPU kernel; the forward's bits are vLLM's, the gradient is the attention's).

    The sequences of one length go through one batched call: the kernel computes each (sequence,
    head) on its own, so a sequence's gradient is what it would be alone, and the call spreads over
    the threads where one sequence's heads do not (a batch of equal lengths: ~15% of the backward's
    attention time at 2 threads)."""
    gq = torch.empty_like(q, dtype=torch.float32)
    gk = torch.empty_like(k, dtype=torch.float32)
    gv = torch.empty_like(v, dtype=torch.float32)
    starts_by_length: dict[int, list[int]] = {}
    start = 0
    for n in seq_lens:
        starts_by_length.setdefault(n, []).append(start)
        start += n
    for n, starts in starts_by_length.items():
        rows = torch.cat([torch.arange(s, s + n, device=q.device) for s in starts])
        b = len(starts)

        def heads_first(t, heads):  # [b * n, heads * D] -> [b, heads, n, D], fp32
            return t.index_select(0, rows).float().view(b, n, heads, head_dim).transpose(1, 2)

        qs, ks, vs = (heads_first(t, h).requires_grad_(True)
                      for t, h in ((q, num_heads), (k, num_kv_heads), (v, num_kv_heads)))
        gs = heads_first(g, num_heads)
        allowed = None if sliding_window is None else ~masked_positions(n, sliding_window, q.device)
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=allowed, is_causal=allowed is None, scale=scale,
                enable_gqa=num_heads != num_kv_heads)
            grads = torch.autograd.grad(out, (qs, ks, vs), gs)
        for whole, part in zip((gq, gk, gv), grads):
            whole.index_copy_(0, rows, part.transpose(1, 2).reshape(b * n, -1))
    return gq, gk, gv


class _AttentionFn(Function):
    @staticmethod
    def forward(ctx, q, k, v, attn: AlignedAttention, plan, seq_lens):
        ctx.save_for_backward(q, k, v)
        ctx.attn = attn
        ctx.seq_lens = seq_lens
        return attn.kernel(q, k, v, plan)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        a = ctx.attn
        gq, gk, gv = attention_backward(
            q, k, v, g, ctx.seq_lens, a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.sliding_window
        )
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None, None
