"""How long a sequence the demo's engine and aligned learner keep bitwise on this host's CPU.

vLLM's CPU attention folds keys into its softmax in KV tiles sized from the L2 cache, shorter for
the learner's full forward than for the engine's decode steps; :func:`bitwise_context_tokens`
computes the shortest tile with the kernel's own arithmetic (vLLM 0.31.0), so the demo refuses a
conversation longer than that up front. See docs/demo.md.
"""

from __future__ import annotations

import functools
import platform

# cpu_attn_vec.hpp (ISA::VEC): KV token unit of the QK and PV phases, query heads per register tile.
VEC_BLOCK_SIZE_ALIGNMENT = 32
VEC_MAX_Q_HEADS_PER_ITERATION = 8
# AttentionScheduler::MaxQTileIterNum
MAX_Q_TILE_ITER_NUM = 128
# The VEC kernel's buffers (query, logits, partial output) are fp32; the demo's KV cache is fp32.
BUFFER_BYTES = 4
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")


def _round_down(value: int, unit: int) -> int:
    return max((value // unit) * unit, unit)


def vec_kernel_bitwise_tokens(l2_cache_bytes: int, head_dim: int, q_heads_per_kv: int,
                              kv_cache_bytes: int = BUFFER_BYTES) -> int:
    """The shortest KV tile vLLM's VEC attention uses for a query tile of the default size: the
    longest sequence whose every row sees its keys in a single tile whatever its query tile."""
    m, align = VEC_MAX_Q_HEADS_PER_ITERATION, VEC_BLOCK_SIZE_ALIGNMENT
    cache = l2_cache_bytes >> 1  # cpu_utils::get_available_l2_size: half of L2
    # calcu_default_tile_size: query and key tiles of the same size, KV and logits in the cache.
    tile = cache // (head_dim * (BUFFER_BYTES + 2 * kv_cache_bytes + BUFFER_BYTES) + m * BUFFER_BYTES)
    tile = _round_down(min(tile, MAX_Q_TILE_ITER_NUM * m), m)
    heads_per_kv = q_heads_per_kv if m % q_heads_per_kv == 0 else 1  # GQA packing, else one head per row
    q_heads = (tile // heads_per_kv) * heads_per_kv
    q_heads = -(-q_heads // m) * m
    # calcu_tile_size_with_constant_q; a query tile of one register tile is "one round" (KV not cached).
    rest = cache - q_heads * head_dim * (BUFFER_BYTES + BUFFER_BYTES)
    if q_heads <= m:
        kv_tile = rest // (BUFFER_BYTES * m)
    else:
        kv_tile = rest // (BUFFER_BYTES * m + 2 * head_dim * kv_cache_bytes)
    return _round_down(kv_tile, align)


@functools.lru_cache(maxsize=None)
def _host_l2_cache_bytes() -> int | None:
    import torch

    try:
        size = int(torch.cpu.get_capabilities().get("l2_cache_size", 0))
    except Exception:  # noqa: BLE001 - an older torch without the capability table: unknown
        return None
    return size or None


def bitwise_context_tokens(head_dim: int, num_heads: int, num_kv_heads: int) -> int | None:
    """Tokens a sequence may reach on this host with the demo's fp32 engine and aligned learner
    staying bitwise equal; ``None`` where the host's attention kernel is not the VEC one."""
    if platform.machine().lower() not in X86_MACHINES or head_dim % 32:
        return None  # ARM (NEON), POWER, s390x, RISC-V, or VEC16 heads: other tile rules
    l2 = _host_l2_cache_bytes()
    if l2 is None:
        return None
    return vec_kernel_bitwise_tokens(l2, head_dim, num_heads // num_kv_heads)
