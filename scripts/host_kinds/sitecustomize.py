"""Makes every Python process started with this folder on ``PYTHONPATH`` see a smaller x86 CPU:
the host kind named by ``ZMRL_AS_HOST_KIND`` (``avx2``: no AVX-512, no AVX-512-bf16, no AMX;
``avx512``: AVX-512 as the host has it, but no AVX-512-bf16 and no AMX). Unset: nothing changes.

vLLM picks its CPU kernel library from torch's answers to "AVX-512?" and "AVX-512 with bf16?"
(``CpuPlatform.import_kernels``: ``_C``, ``_C_AVX512`` or ``_C_AVX2``), and takes its AVX-512-bf16
and AMX Python paths (accelerated gated delta-net, the conv-state layout, the AMX GEMMs) from the
same answers. Lowering them here makes vLLM load the library that host kind loads, in the test
process and in every engine and rank process it spawns (each starts a fresh interpreter, which
imports this module). ``scripts/run_as_host_kind.sh`` adds the matching MKL, oneDNN and aten paths.

Answers are only ever lowered: a host cannot be made to run an ISA it lacks. What this cannot do
either: make the host's own instructions disappear. An instruction the smaller CPU lacks still
runs here; only the code paths are that host kind's.
"""

import os

_LOWERED = {
    "avx2": ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    "avx512": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
}


def _absent() -> bool:
    return False


_kind = os.environ.get("ZMRL_AS_HOST_KIND")
if _kind and _kind not in _LOWERED:
    raise ValueError(f"ZMRL_AS_HOST_KIND={_kind!r}: use one of {', '.join(_LOWERED)}, or unset it")
if _kind:
    import torch.cpu

    for _query in _LOWERED[_kind]:
        setattr(torch.cpu, _query, _absent)
