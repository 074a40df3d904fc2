"""vLLM's attention backend, driven the way the engine's model runner drives it.

A real vLLM ``Attention`` layer under the engine's config: the engine's backend, its metadata
builder, its KV-cache write into a scratch paged cache and ``impl.forward``; every query row
attends its own sequence's cache, as a decode step does. See docs/zero-mismatch.md.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

_layer_ids = itertools.count()


def _scratch_cache(backend, num_blocks, num_kv_heads, block_size, head_dim, dtype, device):
    """A zeroed per-layer cache with logical shape [B, H, N, 2*D] in the backend's layout."""
    logical = (num_blocks, num_kv_heads, block_size, 2 * head_dim)
    layouts = backend.supported_kv_cache_layouts()
    if not layouts:
        return torch.zeros(logical, dtype=dtype, device=device)
    order = layouts[0].layer_view_order  # physical order of the logical axes
    physical = torch.zeros([logical[i] for i in order], dtype=dtype, device=device)
    inverse = [order.index(i) for i in range(4)]
    return physical.permute(*inverse)


class BackendPagedAttention:
    """Causal attention over packed sequences through the engine's attention backend."""

    def __init__(
        self,
        runtime,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ):
        from vllm.model_executor.layers.attention import Attention
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.runtime = runtime
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        cfg = runtime.vllm_config
        self.cache_config = cfg.cache_config
        if self.cache_config.cache_dtype != "auto":
            raise NotImplementedError("the aligned trainer supports kv_cache_dtype='auto' only")
        self.layer_name = f"zmrl_aligned.{next(_layer_ids)}.attn"
        with runtime.context(), set_default_torch_dtype(runtime.dtype):
            self.layer = Attention(
                num_heads,
                head_dim,
                scale,
                num_kv_heads=num_kv_heads,
                cache_config=self.cache_config,
                per_layer_sliding_window=sliding_window,
                prefix=self.layer_name,
            )
            self.layer.to(runtime.device)
            self.layer.process_weights_after_loading(runtime.dtype)
            self.backend = self.layer.attn_backend
            self.spec = self.layer.get_kv_cache_spec(cfg)
            self.block_size = self.spec.block_size
            self.builder = self.backend.get_builder_cls()(
                self.spec, [self.layer_name], cfg, runtime.device
            )

    @property
    def backend_name(self) -> str:
        return self.backend.get_name()

    def metadata(self, seq_lens: list[int]):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        device = self.runtime.device
        bs = self.block_size
        blocks = [(n + bs - 1) // bs for n in seq_lens]
        block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        slots = []
        next_block = 0
        for i, (n, b) in enumerate(zip(seq_lens, blocks)):
            ids = torch.arange(next_block, next_block + b, dtype=torch.int32)
            block_table[i, :b] = ids
            pos = torch.arange(n, dtype=torch.int64)
            slots.append(ids[pos // bs].to(torch.int64) * bs + pos % bs)
            next_block += b
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        qsl_cpu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.cumsum(seq_lens_cpu, 0)
        slot_mapping = torch.cat(slots).to(device)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens_cpu.to(device),
            num_reqs=len(seq_lens),
            num_actual_tokens=int(qsl_cpu[-1]),
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=block_table.to(device),
            slot_mapping=slot_mapping,
            causal=True,
        )
        with self.runtime.context():
            meta = self.builder.build(common_prefix_len=0, common_attn_metadata=common)
        return SimpleNamespace(meta=meta, num_blocks=next_block, slot_mapping=slot_mapping)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] packed -> [T, H*D]."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        kv_cache = _scratch_cache(
            self.backend, plan.num_blocks, kvh, self.block_size, d, q.dtype, q.device
        )
        key = k.view(-1, kvh, d)
        value = v.view(-1, kvh, d)
        impl = self.layer.impl
        if not self.backend.forward_includes_kv_cache_update:
            impl.do_kv_cache_update(self.layer, key, value, kv_cache, plan.slot_mapping)
        output = torch.empty(q.shape[0], h * d, dtype=q.dtype, device=q.device)
        impl.forward(
            self.layer, q.view(-1, h, d), key, value, kv_cache, plan.meta, output.view(-1, h, d)
        )
        return output
