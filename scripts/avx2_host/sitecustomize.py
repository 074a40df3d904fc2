"""Makes every Python process started with this folder on ``PYTHONPATH`` see an AVX2-only x86 CPU.

vLLM picks its CPU kernel library from torch's answers to "AVX-512?" and "AVX-512 with bf16?"
(``CpuPlatform.import_kernels``: ``_C``, ``_C_AVX512`` or ``_C_AVX2``), and takes its AVX-512-bf16
Python paths (accelerated gated delta-net, the conv-state layout) from the same answers. Answering
"no" to all three here makes vLLM load ``_C_AVX2``, the build an AVX2-only host loads, in the test
process and in every engine and rank process it spawns (they start a fresh interpreter, which
imports this module). ``scripts/run_as_avx2_host.sh`` adds the matching MKL, oneDNN and aten paths.

What this cannot do: make the host's own instructions disappear. An instruction an AVX2-only CPU
lacks still runs here; only the code paths are the AVX2 host's.
"""

import torch.cpu


def _absent() -> bool:
    return False


torch.cpu._is_avx512_supported = _absent
torch.cpu._is_avx512_bf16_supported = _absent
torch.cpu._is_amx_tile_supported = _absent
