"""Batch-invariant GPU kernels (Triton) for trainer-side ops, usable without vLLM.

Every kernel computes one output row (or tile of rows) with a reduction order that depends only
on the reduced dimension, never on how many rows are in the call: RMSNorm and log-softmax run one
program per row over fixed-size chunks; the matmul uses one fixed tile shape with no split-K;
attention runs one program per (query row, head) over fixed-size key blocks starting at key 0, so
a query row gives the same bits in a prefill of many rows as in a single-row decode step. These
are the properties vLLM's batch-invariant mode provides on GPUs; :mod:`.gpu_check` verifies them
on a device. On a machine with vLLM, the aligned ops call vLLM's own kernels instead.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False

NORM_BLOCK = 1024
SOFTMAX_BLOCK = 1024
MM_BLOCK_M, MM_BLOCK_N, MM_BLOCK_K = 64, 64, 32
ATTN_BLOCK_N = 64


def _require_triton():
    if not HAVE_TRITON:
        raise RuntimeError("triton is required for the batch-invariant GPU kernels")


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = x * rstd * w
            tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _log_softmax_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        running = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
            running = tl.maximum(running, x.to(tl.float32))
        row_max = tl.max(running, axis=0)
        sums = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
            sums += tl.exp(x.to(tl.float32) - row_max)
        log_z = row_max + tl.log(tl.sum(sums, axis=0))
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * stride_o + cols, x - log_z, mask=mask)

    @triton.jit
    def _matmul_kernel(
        a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=(offs_m[:, None] < M) & (ks[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                b_ptr + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=(ks[:, None] < K) & (offs_n[None, :] < N),
                other=0.0,
            )
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc += bias[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _attention_row_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, q_pos_ptr, k_start_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        n_keys = tl.load(q_pos_ptr + row) + 1
        k_start = tl.load(k_start_ptr + row)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row * stride_qt + head * stride_qh + dims).to(tl.float32)
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), dtype=tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            valid = keys < n_keys
            t = k_start + keys
            k = tl.load(
                k_ptr + t[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(
                v_ptr + t[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            ).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(o_ptr + row * stride_ot + head * stride_oh + dims, out.to(o_ptr.dtype.element_ty))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _require_triton()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out, x2.stride(0), out.stride(0), x2.shape[1], eps, BLOCK=NORM_BLOCK
    )
    return out.reshape(x.shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim."""
    _require_triton()
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    _log_softmax_kernel[(x2.shape[0],)](
        x2, out, x2.stride(0), out.stride(0), x2.shape[1], BLOCK=SOFTMAX_BLOCK
    )
    return out.reshape(x.shape)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with one fixed tile shape and no split-K."""
    _require_triton()
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, MM_BLOCK_M), triton.cdiv(n, MM_BLOCK_N))
    _matmul_kernel[grid](
        x2, weight, out, bias if bias is not None else out, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(1), weight.stride(0), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=MM_BLOCK_M, BLOCK_N=MM_BLOCK_N, BLOCK_K=MM_BLOCK_K,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for arbitrary query rows.

    q: [Tq, H, D]; k, v: [Tk, KVH, D]. Query row i attends keys
    ``key_starts[i] .. key_starts[i] + query_positions[i]`` (its sequence's first token up to
    itself). A prefill passes all rows of a sequence; a decode step passes one row against the
    keys cached so far — the computation per row is the same.
    """
    _require_triton()
    tq, h, d = q.shape
    group = h // k.shape[1]
    out = torch.empty_like(q)
    qpos = query_positions.to(device=q.device, dtype=torch.int32).contiguous()
    kst = key_starts.to(device=q.device, dtype=torch.int32).contiguous()
    _attention_row_kernel[(tq, h)](
        q, k, v, out, qpos, kst,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), scale,
        GROUP=group, HEAD_DIM=d, BLOCK_N=ATTN_BLOCK_N,
    )  # fmt: skip
    return out
