"""Each aligned op: forward is vLLM's kernel, backward matches float64 autograd.

The reference for every op is the textbook formula evaluated in float64 with torch autograd. The
aligned backward (fp32, analytic) must agree to a relative L2 error of OP_GRAD_REL_TOL per
input; its forward (vLLM's kernel, fp32) must agree with the float64 formula to OP_FWD_REL_TOL.
"""

import pytest
import torch

from zero_mismatch_plugin.aligned.ops import AlignedAttention, AlignedLinear, AlignedLogits, AlignedRMSNorm
from zero_mismatch_plugin.aligned.ops import AlignedRotary, AlignedSiluAndMul

OP_GRAD_REL_TOL = 1e-5
OP_FWD_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def runtime(checkpoints):
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    return VllmRuntime(checkpoints["llama"], max_model_len=256)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _leaf(*shape, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=_gen(seed))).requires_grad_()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _compare(aligned_fn, reference_fn, inputs, seed=100):
    """Run both on the same leaves with a random cotangent; check outputs and gradients."""
    out = aligned_fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    cotangents = [torch.randn(o.shape, generator=_gen(seed + i)) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, inputs, cotangents)

    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref = reference_fn(*ref_inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    ref_grads = torch.autograd.grad(refs, ref_inputs, [c.double() for c in cotangents])

    for o, r in zip(outs, refs):
        assert _rel(o.detach(), r.detach()) < OP_FWD_REL_TOL
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        rel = _rel(g, r)
        assert rel < OP_GRAD_REL_TOL, f"input {i}: relative gradient error {rel:.3g}"


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_rms_norm(runtime):
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(256, generator=_gen(1)))
    norm = AlignedRMSNorm(runtime, w, 1e-6)
    x = _leaf(7, 256, seed=2)
    _compare(lambda x, w: norm(x), lambda x, w: _rms(x, w, 1e-6), [x, w])


def test_rms_norm_per_head_3d(runtime):
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(64, generator=_gen(1)))
    norm = AlignedRMSNorm(runtime, w, 1e-6)
    x = _leaf(5, 4, 64, seed=3)
    _compare(lambda x, w: norm(x), lambda x, w: _rms(x, w, 1e-6), [x, w])


def test_fused_add_rms_norm(runtime):
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(256, generator=_gen(1)))
    norm = AlignedRMSNorm(runtime, w, 1e-6)
    x, r = _leaf(6, 256, seed=4), _leaf(6, 256, seed=5)
    _compare(
        lambda x, r, w: norm(x, r),
        lambda x, r, w: (_rms(x + r, w, 1e-6), x + r),
        [x, r, w],
    )


def test_fused_add_rms_norm_of_one_tensor_as_input_and_residual(runtime):
    """x and residual share the sum's gradient (one tensor handed back for both): where they are the
    same tensor autograd must add the two, not write one over the other."""
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(256, generator=_gen(1)))
    norm = AlignedRMSNorm(runtime, w, 1e-6)
    x = _leaf(6, 256, seed=4)

    def input_and_residual_one_tensor(x, w):
        h = 2 * x
        return norm(h, h)

    _compare(input_and_residual_one_tensor, lambda x, w: (_rms(4 * x, w, 1e-6), 4 * x), [x, w])


def test_rotary(runtime):
    rotary = AlignedRotary(runtime, 64, 512, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 7, 100])
    q, k = _leaf(8, 4 * 64, seed=6), _leaf(8, 2 * 64, seed=7)
    cos_sin = rotary.module.cos_sin_cache.index_select(0, positions).double()
    cos, sin = cos_sin.chunk(2, dim=-1)

    def rope(x):
        x = x.view(x.shape[0], -1, 64)
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos[:, None], sin[:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(x.shape[0], -1)

    _compare(lambda q, k: rotary(positions, q, k), lambda q, k: (rope(q), rope(k)), [q, k])


def test_silu_and_mul(runtime):
    act = AlignedSiluAndMul(runtime)
    x = _leaf(9, 2 * 96, seed=8, scale=3.0)
    _compare(act, lambda x: torch.nn.functional.silu(x[:, :96]) * x[:, 96:], [x])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_backward_stays_in_the_dtype_of_the_activations(checkpoints, dtype):
    """A bf16 engine's SwiGLU backward forms transformers' bf16 products (silu_backward computes each
    element in fp32): no [T, d] tensor is widened to fp32 and back. fp32 engines: fp32 throughout.
    Against float64 within the activations' precision."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    engine_dtype = getattr(torch, dtype)
    act = AlignedSiluAndMul(VllmRuntime(checkpoints["llama"], dtype=dtype, max_model_len=256))
    x = (3.0 * torch.randn(9, 2 * 96, generator=_gen(8))).to(engine_dtype).requires_grad_()
    out = act(x)
    cotangent = torch.randn(out.shape, generator=_gen(9)).to(engine_dtype)

    class OutputDtypes(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            self.seen |= {t.dtype for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)}
            return result

    with OutputDtypes() as mode:
        (grad,) = torch.autograd.grad(out, x, cotangent)
    assert mode.seen == {engine_dtype}, mode.seen
    assert grad.dtype == engine_dtype
    reference = x.detach().double().requires_grad_()
    (torch.nn.functional.silu(reference[:, :96]) * reference[:, 96:]).backward(cotangent.double())
    error = _rel(grad, reference.grad)
    print(f"{dtype} SwiGLU backward vs float64: {error:.3g}")
    assert error < (OP_GRAD_REL_TOL if dtype == "float32" else 1e-2)


def test_merged_linear_with_bias(runtime):
    parts = [torch.nn.Parameter(0.1 * torch.randn(n, 256, generator=_gen(10 + n))) for n in (256, 128, 128)]
    biases = [torch.nn.Parameter(0.1 * torch.randn(n, generator=_gen(20 + n))) for n in (256, 128, 128)]
    linear = AlignedLinear(runtime, parts, biases)
    x = _leaf(11, 256, seed=9)

    def reference(x, *p):
        return x @ torch.cat(p[:3]).t() + torch.cat(p[3:])

    _compare(lambda x, *p: linear(x), reference, [x, *parts, *biases])


def test_linear_with_engine_rows_runs_the_engine_layout_and_answers_in_the_trainers(runtime):
    """A trainer storing the rows in another order (megatron's grouped qkv) gets the engine's GEMM
    bits, permuted back, and gradients in its own order."""
    engine_w = torch.randn(96, 256, generator=_gen(40))
    engine_b = torch.randn(96, generator=_gen(41))
    engine_rows = torch.randperm(96, generator=_gen(42))  # trainer row of each engine row
    trainer_cols = torch.argsort(engine_rows)
    w = torch.nn.Parameter(torch.empty_like(engine_w))
    b = torch.nn.Parameter(torch.empty_like(engine_b))
    with torch.no_grad():
        w[engine_rows] = engine_w
        b[engine_rows] = engine_b
    permuted = AlignedLinear(runtime, [w], [b], engine_rows=engine_rows)
    plain = AlignedLinear(runtime, [torch.nn.Parameter(engine_w)], [torch.nn.Parameter(engine_b)])
    x = torch.randn(7, 256, generator=_gen(43))
    assert torch.equal(permuted.kernel(x), plain.kernel(x).index_select(-1, trainer_cols))
    assert not torch.equal(permuted.kernel(x), plain.kernel(x))  # the permutation is not a no-op
    _compare(lambda x, w, b: permuted(x), lambda x, w, b: x @ w.t() + b, [_leaf(7, 256, seed=44), w, b])


def test_linear_rederives_after_in_place_update(runtime):
    w = torch.nn.Parameter(torch.randn(64, 256, generator=_gen(30)))
    linear = AlignedLinear(runtime, [w])
    x = torch.randn(5, 256, generator=_gen(31))
    before = linear(x).detach()
    with torch.no_grad():
        w.mul_(2.0)  # what an optimizer step does: an in-place update
    after = linear(x).detach()
    assert torch.equal(after, linear.kernel(x))
    assert torch.allclose(after, 2 * before, rtol=1e-5, atol=1e-5)


def test_attention_packed_gqa(runtime):
    attn = AlignedAttention(runtime, 4, 2, 64, 64**-0.5)
    seq_lens = [5, 1, 9]
    t = sum(seq_lens)
    q, k, v = _leaf(t, 4 * 64, seed=12), _leaf(t, 2 * 64, seed=13), _leaf(t, 2 * 64, seed=14)
    plan = attn.plan(seq_lens)

    def reference(q, k, v):
        out, start = [], 0
        for n in seq_lens:
            qs = q[start : start + n].view(n, 4, 64).transpose(0, 1)
            ks = k[start : start + n].view(n, 2, 64).transpose(0, 1).repeat_interleave(2, 0)
            vs = v[start : start + n].view(n, 2, 64).transpose(0, 1).repeat_interleave(2, 0)
            s = qs @ ks.transpose(1, 2) * 64**-0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out.append((s.softmax(-1) @ vs).transpose(0, 1).reshape(n, -1))
            start += n
        return torch.cat(out)

    _compare(lambda q, k, v: attn(q, k, v, plan, seq_lens), reference, [q, k, v])


def test_logits_head_padded_vocab(runtime):
    w = torch.nn.Parameter(0.1 * torch.randn(500, 256, generator=_gen(15)))  # pads to 512
    head = AlignedLogits(runtime, w, 500)
    assert head.padded_vocab == 512
    h = _leaf(6, 256, seed=16)
    _compare(lambda h, w: head(h), lambda h, w: h @ w.t(), [h, w])


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_attention_backward_takes_the_sequences_of_one_length_in_one_call(monkeypatch, sliding_window):
    """Three lengths among six packed sequences: three recomputed attention calls, and each
    sequence's gradients those of the sequence differentiated alone."""
    from zero_mismatch_plugin.aligned import ops

    seq_lens = [5, 9, 5, 2, 9, 5]
    t = sum(seq_lens)
    q, k, v, g = (torch.randn(t, heads * 16, generator=_gen(20 + i)) for i, heads in enumerate((4, 2, 2, 4)))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    grouped = ops.attention_backward(q, k, v, g, seq_lens, 4, 2, 16, 0.25, sliding_window)
    assert sorted(calls) == [1, 2, 3], calls  # batches of one, two and three sequences
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        alone = ops.attention_backward(q[rows], k[rows], v[rows], g[rows], [n], 4, 2, 16, 0.25, sliding_window)
        for whole, part in zip(grouped, alone):
            torch.testing.assert_close(whole[rows], part, rtol=1e-6, atol=1e-7)
        start += n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_backward_runs_its_gemms_in_the_dtype_of_the_forwards_operands(checkpoints, dtype):
    """The consistent-mode head of a bf16 engine computes fp32 logits from bf16 weights and hidden
    states; its backward's GEMMs run in bf16 (fp32 accumulation), as autocast runs a bf16 GEMM's
    backward, and in fp32 for an fp32 engine. The gradients have the parameters' dtypes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zero_mismatch_plugin.aligned.runtime import VllmRuntime

    engine_dtype = getattr(torch, dtype)
    head = AlignedLogits(VllmRuntime(checkpoints["llama"], dtype=dtype, max_model_len=256),
                         torch.nn.Parameter(0.1 * torch.randn(512, 256, generator=_gen(17))), 512)
    hidden = torch.randn(6, 256, generator=_gen(18)).to(engine_dtype).requires_grad_()
    logits = head(hidden)
    assert logits.dtype == torch.float32

    class GemmDtypes(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
                self.seen.append((args[0].dtype, args[1].dtype))
            return func(*args, **(kwargs or {}))

    with GemmDtypes() as mode:
        grad_hidden, grad_weight = torch.autograd.grad(logits, (hidden, head.weight), torch.randn(logits.shape))
    assert mode.seen and set(mode.seen) == {(engine_dtype, engine_dtype)}, mode.seen
    assert grad_hidden.dtype == engine_dtype and grad_weight.dtype == torch.float32
