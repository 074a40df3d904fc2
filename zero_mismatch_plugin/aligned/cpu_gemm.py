"""Batch (in)variance of vLLM's CPU GEMM, and the invariant decode path.

On some hosts vLLM's oneDNN linear rounds a one-row call (a lone decoding sequence) unlike M >= 2;
consistent mode runs it as two rows. On hosts with AMX tiles vLLM's half-precision GEMMs vary over
a wider range of row counts: consistent mode sends those weights to the sgl-kernel, whose rows
vary only below five, and runs smaller calls as :data:`AMX_SGL_KERNEL_MIN_ROWS` rows
(:func:`min_rows_for`, :func:`sgl_kernel_for_every_size`). On x86 hosts without bf16 instructions
half-precision GEMMs run as fp32 GEMMs rounded once (:func:`fp32_gemm_for`, :func:`in_fp32`). :func:`probe_linear`
checks a layer's rows against M and :func:`require_invariant` refuses a variant one. See docs/hosts.md.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

import torch

# Row counts compared against the reference (largest) batch.
PROBE_ROWS = (1, 2, 3, 5, 8, 17, 64, 96)
PROBE_REFERENCE_ROWS = 129

# Measured on an Intel Xeon with AMX (amx_bf16, amx_tile), bf16 weights, 1 and 2 threads, rows of
# calls of M rows against a call of 129: oneDNN's GEMM (vLLM's choice for weights over 1 MiB) differs
# at M = 2-36 for K <= 2048, and at M up to 128 for K = 4096 and 5632; the sgl-kernel GEMM
# (``weight_packed_linear``, vLLM's choice up to 1 MiB) at M = 1-4 only, for every shape measured
# (N x K from 2816 x 512 to 2048 x 5632), also at another offset in the call. So on such a host
# consistent mode sends every half-precision weight the sgl-kernel takes to it, and pads its calls of
# fewer than 8 rows; a shape it cannot take stays with oneDNN, calls padded to 64 rows, and is
# refused by the trainer's probe where its rows still vary.
AMX_SGL_KERNEL_MIN_ROWS = 8
AMX_HALF_PRECISION_MIN_ROWS = 64

_WRAPPED_FLAG = "_zmrl_min_rows"
HALF_PRECISION = (torch.bfloat16, torch.float16)


class BatchVariantShapeError(RuntimeError):
    """A GEMM shape whose per-row bits depend on the number of rows in the call."""


@dataclass
class GemmProbe:
    n: int
    k: int
    variant_rows: list[int] = field(default_factory=list)

    @property
    def invariant(self) -> bool:
        return not self.variant_rows


def host_has_amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def _half_precision_with_amx(dtype: torch.dtype) -> bool:
    """Weights in ``dtype`` take vLLM's AMX kernels on this host."""
    return dtype in HALF_PRECISION and host_has_amx()


def min_rows_for(dtype: torch.dtype, sgl_kernel: bool = False) -> int:
    """The fewest rows consistent mode lets vLLM's CPU GEMM compute for weights in ``dtype`` on
    this host: with AMX tiles, for half precision, :data:`AMX_SGL_KERNEL_MIN_ROWS` where the weight
    went to the sgl-kernel (``sgl_kernel``), else :data:`AMX_HALF_PRECISION_MIN_ROWS` (oneDNN);
    otherwise 2 (one row is the only count known to round differently)."""
    if _half_precision_with_amx(dtype):
        return AMX_SGL_KERNEL_MIN_ROWS if sgl_kernel else AMX_HALF_PRECISION_MIN_ROWS
    return 2


def fp32_gemm_for(dtype: torch.dtype) -> bool:
    """Whether consistent mode computes vLLM's CPU GEMM for weights in ``dtype`` as an fp32 GEMM of
    the upcast operands, rounded once to ``dtype`` (:func:`in_fp32`): half precision on an x86 host
    with neither AVX-512-bf16 nor AMX tiles, whose bf16 GEMMs have no bf16 instructions to run on.

    On such a host oneDNN's bf16 GEMM (AVX-512 without bf16) split its work by the row count, so at
    2 threads a row's bits changed with the rows in the call (scattered counts 2-127; torch's bf16
    linear the same); on AVX2 oneDNN declines bf16 and vLLM falls back to torch's linear. The fp32
    GEMM's rows do not depend on the row count at 2 threads, and it was 1.4-2.8x (AVX-512) and 2.5-3.4x
    (AVX2) faster than those bf16 GEMMs at 2 threads (measured as the ``avx512`` / ``avx2`` host kinds,
    docs/hosts.md). The products of half-precision values are exact in fp32, so this is a bf16 GEMM
    with fp32 accumulation, summed in the fp32 kernel's order."""
    return (dtype in HALF_PRECISION and platform.machine().lower() in ("x86_64", "amd64")
            and not torch.cpu._is_avx512_bf16_supported() and not host_has_amx())


def in_fp32(fp32_linear, fp32_weight: torch.Tensor, dtype: torch.dtype):
    """A ``cpu_linear(x, weight, bias)`` in ``dtype`` computed by ``fp32_linear`` (the linear vLLM's
    dispatch made for ``fp32_weight``, the layer's weight upcast): the input and bias upcast, the fp32
    result rounded once to ``dtype``. The layer's own weight argument is not read."""

    def linear(x, weight, bias):
        out = fp32_linear(x.float(), fp32_weight, None if bias is None else bias.float())
        return out.to(dtype)

    return linear


def sgl_kernel_for_every_size(dtype: torch.dtype) -> bool:
    """Whether consistent mode lifts vLLM's 1 MiB bound on the sgl-kernel GEMM for weights in
    ``dtype``: half precision on a host with AMX tiles (see :data:`AMX_SGL_KERNEL_MIN_ROWS`)."""
    return _half_precision_with_amx(dtype)


def pad_rows(cpu_linear, min_rows: int = 2):
    """Wrap a vLLM ``layer.cpu_linear`` so an input of fewer than ``min_rows`` rows is computed
    as ``min_rows`` rows (zero rows appended, their outputs dropped)."""
    if padded_rows(cpu_linear):
        return cpu_linear

    def linear(x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= min_rows or rows.shape[0] == 0:
            return cpu_linear(x, weight, bias)
        padded = torch.cat([rows, rows.new_zeros(min_rows - rows.shape[0], rows.shape[1])], dim=0)
        out = cpu_linear(padded, weight, bias)[: rows.shape[0]]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    setattr(linear, _WRAPPED_FLAG, min_rows)
    return linear


def pad_single_row(cpu_linear):
    """Wrap a vLLM ``layer.cpu_linear`` so a one-row input is computed as two rows."""
    return pad_rows(cpu_linear, 2)


def padded_rows(cpu_linear) -> int:
    """The rows a :func:`pad_rows` wrapper computes at least (0: not wrapped)."""
    return int(getattr(cpu_linear, _WRAPPED_FLAG, 0) or 0)


def probe_linear(
    apply, n: int, k: int, dtype=torch.float32, seed: int = 0, rows=PROBE_ROWS
) -> GemmProbe:
    """Compare rows of ``apply(x)`` (x: [M, k]) computed with M in ``rows`` against one large M."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(PROBE_REFERENCE_ROWS, k, generator=gen).to(dtype)
    with torch.no_grad():
        reference = apply(x)
        probe = GemmProbe(n=n, k=k)
        for m in rows:
            if not torch.equal(apply(x[:m].contiguous()), reference[:m]):
                probe.variant_rows.append(m)
    return probe


def require_invariant(probe: GemmProbe, what: str) -> None:
    if not probe.invariant:
        raise BatchVariantShapeError(
            f"{what}: vLLM's CPU GEMM (N={probe.n}, K={probe.k}) gives different bits for "
            f"M in {probe.variant_rows} than for M={PROBE_REFERENCE_ROWS}; the engine's decode "
            "and the trainer's packed forward cannot agree for this shape. Refusing in "
            "consistent mode."
        )


def _require_invariant_shapes(kernels) -> dict:
    """Probe ``kernels`` ((name, (n, k), dtype, make_apply): ``make_apply()`` gives ``x -> x W^T``)
    once per distinct shape and dtype; refuse one whose rows depend on M. Returns {name: probe}."""
    results, seen = {}, {}
    for name, (n, k), dtype, make_apply in kernels:
        key = (n, k, dtype)
        if key not in seen:
            seen[key] = probe_linear(make_apply(), n=n, k=k, dtype=dtype)
            require_invariant(seen[key], name)
        results[name] = seen[key]
    return results


def require_invariant_gemms(linears: dict, head, hidden_size: int, dtype) -> dict:
    """Probe every distinct GEMM shape of a trainer's ``linears`` ({name: ``AlignedLinear``}) and
    of its logits ``head`` (an ``AlignedLogits``); refuse one whose rows depend on M.

    Single-row calls are part of the probe: the trainer never makes them, but a lone decoding
    sequence in the engine does, and the engine only matches when the plugin's single-row padding
    is in place (consistent mode) or the kernel is row-invariant anyway. Returns {name: probe}.
    """
    results = _require_invariant_shapes(
        (name, tuple(linear.derived.get()[1].shape), dtype, lambda lin=linear: lin.kernel)
        for name, linear in linears.items())
    results["lm_head"] = probe_linear(head.kernel, n=head.padded_vocab, k=hidden_size, dtype=dtype)
    require_invariant(results["lm_head"], "lm_head")
    return results


def require_invariant_packed_gemms(weights: dict) -> dict:
    """Probe the GEMMs of the CPU LoRA-capable MoE experts (``packed_cpu_linear``: vLLM's dispatch
    with the consistent mode's padding, packed from a weight) for each distinct shape and dtype of
    ``weights`` ({name: a 2-D weight of that shape and dtype; values do not matter}); refuse one whose
    rows depend on M. Returns {name: probe}."""
    from zero_mismatch_plugin.aligned.cpu_lora_experts import packed_cpu_linear

    return _require_invariant_shapes(
        (name, tuple(weight.shape), weight.dtype, lambda w=weight: packed_cpu_linear(w))
        for name, weight in weights.items())
