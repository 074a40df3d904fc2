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

    def metadata(self, seq_lens: list[int], queries: list[tuple[int, int, int]] | None = None):
        """The backend's metadata for packed sequences of ``seq_lens``, whose keys and values are
        written to the cache whole. ``queries``: the requests, each ``(sequence, first row, end
        row)``: its queries are those rows and its context the sequence up to ``end``, as in a
        chunked prefill (context parallelism's chunks); default, every sequence whole."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        device = self.runtime.device
        bs = self.block_size
        blocks = [(n + bs - 1) // bs for n in seq_lens]
        first_block = [sum(blocks[:i]) for i in range(len(seq_lens))]
        slots = []
        for n, start in zip(seq_lens, first_block):
            pos = torch.arange(n, dtype=torch.int64)
            slots.append((start + pos // bs) * bs + pos % bs)
        requests = queries if queries is not None else [(i, 0, n) for i, n in enumerate(seq_lens)]
        block_table = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
        for row, (i, _, _) in enumerate(requests):
            block_table[row, : blocks[i]] = torch.arange(first_block[i], first_block[i] + blocks[i], dtype=torch.int32)
        contexts = torch.tensor([end for _, _, end in requests], dtype=torch.int32)
        query_lens = torch.tensor([end - first for _, first, end in requests], dtype=torch.int32)
        qsl_cpu = torch.zeros(len(requests) + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.cumsum(query_lens, 0)
        slot_mapping = torch.cat(slots).to(device)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=contexts.to(device),
            num_reqs=len(requests),
            num_actual_tokens=int(qsl_cpu[-1]),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(contexts.max()),
            block_table_tensor=block_table.to(device),
            slot_mapping=slot_mapping,
            causal=True,
        )
        with self.runtime.context():
            meta = self.builder.build(common_prefix_len=0, common_attn_metadata=common)
        return SimpleNamespace(meta=meta, num_blocks=sum(blocks), slot_mapping=slot_mapping)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan) -> torch.Tensor:
        """q: [Q, H*D] (the plan's query rows), k/v: [T, KVH*D] (the packed sequences whole) -> [Q, H*D]."""
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
