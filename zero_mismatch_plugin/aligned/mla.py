"""Multi-head latent attention (DeepSeek-V2/V3) as vLLM's CPU MLA backend (``CPU_MLA``) computes it.

Prompt rows go through the engine's prefill backend; every other row is a decode step of one
query (``W_UK`` absorbed, ``_C.mla_decode_kvcache``, ``W_UV``). The backward is the equivalent
dense attention's (:func:`mla_dense_attention`). See docs/vllm-cpu-mla.md, "The aligned trainer".
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.autograd import Function

from zero_mismatch_plugin.aligned.row_invariant import on_one_thread, row_invariant_bmm
from zero_mismatch_plugin.aligned.derived import DerivedWeight, cast_like_engine
from zero_mismatch_plugin.aligned.ops import AlignedLinear, masked_positions, observable

BLOCK_SIZE = 16  # vLLM's CPU MLA forces 16-token cache blocks; its decode kernel reads no other size


@dataclass
class MlaPlan:
    """Which rows the engine computed in a prefill step and which in decode steps, and the latent
    cache layout of the decode rows; one per packed batch, shared by all layers."""

    seq_lens: list[int]
    prefill_rows: torch.Tensor  # [Tp] packed rows of prompts computed by prefill, sequence by sequence
    prefill_query_start: torch.Tensor  # [S_p + 1] int32 row offsets of each prefilled prompt in prefill_rows
    decode_rows: torch.Tensor  # [B] packed rows computed by decode steps
    decode_seq_lens: torch.Tensor  # [B] int32: position + 1, the tokens the decode step attends
    cache_rows: torch.Tensor  # [T] slot of each packed row in the latent cache
    num_blocks: int
    block_table: torch.Tensor  # [B, W] int32: the blocks of the decode row's sequence


def plan_mla(seq_lens: list[int], prompt_lens: list[int], device=None) -> MlaPlan:
    """The engine's split of a packed batch: a prompt of more than one token is one prefill step
    (vLLM's CPU platform turns chunked prefill and prefix caching off for MLA), every other token
    is a decode step (query length 1)."""
    prefill_rows, prefill_starts, decode_rows, decode_lens, cache_rows, tables = [], [0], [], [], [], []
    offset = block_offset = 0
    for n, prompt in zip(seq_lens, prompt_lens):
        if not 0 < prompt <= n:
            raise ValueError(f"prompt length {prompt} outside 1..{n} (the sequence length)")
        first_decode = prompt if prompt > 1 else 0
        if first_decode:
            prefill_rows.extend(range(offset, offset + prompt))
            prefill_starts.append(prefill_starts[-1] + prompt)
        num_blocks = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
        for position in range(first_decode, n):
            decode_rows.append(offset + position)
            decode_lens.append(position + 1)
            tables.append(list(range(block_offset, block_offset + num_blocks)))
        cache_rows.extend(block_offset * BLOCK_SIZE + p for p in range(n))
        block_offset += num_blocks
        offset += n
    table = torch.zeros(len(tables), max((len(t) for t in tables), default=1), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return MlaPlan(
        seq_lens=list(seq_lens),
        prefill_rows=as_long(prefill_rows),
        prefill_query_start=torch.tensor(prefill_starts, dtype=torch.int32, device=device),
        decode_rows=as_long(decode_rows),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
        cache_rows=as_long(cache_rows),
        num_blocks=block_offset,
        block_table=table.to(device),
    )


def mla_dense_attention(q, kv_c_normed, k_pe, kv_b_weight, seq_lens, num_heads, qk_nope_head_dim, v_head_dim, scale):
    """Multi-head latent attention in its dense form (DeepSeek-V2, arXiv:2405.04434, section 2.1.2):
    per head, keys ``[kv_c W_UK_h, k_pe]`` and values ``kv_c W_UV_h`` from the shared latent,
    causal softmax attention per packed sequence.

    q: [T, H, nope + rope] (rotated), kv_c_normed: [T, L], k_pe: [T, rope] (rotated, one head for
    all), kv_b_weight: [H * (nope + v), L]. Returns [T, H * v]. The absorbed decode computes the
    same function with ``W_UK`` folded into the query and ``W_UV`` applied after the attention.
    """
    t = q.shape[0]
    kv = (kv_c_normed @ kv_b_weight.t()).view(t, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(t, num_heads, k_pe.shape[-1])], dim=-1)
    out, start = [], 0
    for n in seq_lens:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))  # H, n, D
        scores = (qs @ ks.transpose(1, 2)) * scale
        scores = scores.masked_fill(masked_positions(n, None, q.device), float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(out)


class AlignedMLAAttention:
    """The attention of one MLA layer: rotated q, latent and rotary key in, [T, H * v] out."""

    def __init__(self, runtime, mla, num_heads: int, scale: float, kv_b_weight: torch.nn.Parameter):
        from vllm import _custom_ops

        if runtime.platform != "cpu":
            raise NotImplementedError(
                "the aligned MLA attention follows vLLM's CPU MLA backend (CPU_MLA); on a GPU the engine "
                "runs another MLA backend, which the aligned trainer does not follow yet"
            )
        block_size = runtime.vllm_config.cache_config.block_size
        if block_size not in (None, BLOCK_SIZE):
            raise ValueError(f"block_size={block_size}: vLLM's CPU MLA runs {BLOCK_SIZE}-token blocks only")
        self.runtime = runtime
        self.mla = mla
        self.num_heads = num_heads
        self.scale = scale
        # One thread, as the patched engine runs it: the kernel's bits depend on the thread count.
        self.decode_kernel = on_one_thread(_custom_ops.mla_decode_kvcache_cpu)
        self.prefill = runtime.mla_prefill(num_heads, scale, mla)
        self.kv_b = AlignedLinear(runtime, [kv_b_weight])  # vLLM's CPU GEMM dispatch, as the patched engine
        self.kv_b_weight = kv_b_weight
        self.absorbed = DerivedWeight([kv_b_weight], self._absorb)

    def _absorb(self, sources):
        """(W_UK_T [H, nope, L], W_UV [H, L, v]) as ``MLAAttention.process_weights_after_loading``
        lays them out: views of the engine-dtype kv_b_proj weight."""
        from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

        holder = SimpleNamespace(weight=cast_like_engine(sources[0], self.runtime.dtype).contiguous(),
                                 quant_method=None)
        m = self.mla
        w_uk, w_uv = split_kv_b_proj(holder, self.runtime.dtype, m.kv_lora_rank, self.num_heads,
                                     m.qk_nope_head_dim, m.v_head_dim)
        return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)

    @observable
    def __call__(self, q, kv_c_normed, k_pe, plan: MlaPlan):
        return _MLAFn.apply(q, kv_c_normed, k_pe, self.kv_b_weight, self, plan)

    # ----- the engine's two paths -----------------------------------------------------------

    def _prefill(self, q, kv_c_normed, k_pe, plan):
        """``MLACommonImpl.forward_mha`` without context: kv_b_proj up, then the prefill backend."""
        m, h = self.mla, self.num_heads
        rows = plan.prefill_rows
        kv_nope = self.kv_b.kernel(kv_c_normed.index_select(0, rows)).view(-1, h, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv_nope.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = k_nope.new_empty(*k_nope.shape[:-1], m.qk_head_dim)
        k[..., : m.qk_nope_head_dim] = k_nope
        k[..., m.qk_nope_head_dim :] = k_pe.index_select(0, rows).unsqueeze(1)
        self.prefill.prepare_metadata(SimpleNamespace(query_start_loc=plan.prefill_query_start))
        out = self.prefill.run_prefill_new_tokens(q=q.index_select(0, rows), k=k, v=v, return_softmax_lse=False)
        return out[..., : m.v_head_dim].flatten(start_dim=-2)

    def _latent_cache(self, kv_c_normed, k_pe, plan):
        """The latent cache [blocks, 16, kv_lora_rank + rope]: each sequence's rows in its own blocks,
        the slots after its last row zero. Every decode row of a sequence reads the same blocks: the
        kernel reads only the first ``seq_len`` slots (later ones, the sequence's later rows here
        and stale data in the engine, do not change its bits: tests/faces/aligned_model/test_aligned_mla.py)."""
        latent = torch.cat([kv_c_normed, k_pe], dim=-1)
        cache = latent.new_zeros(plan.num_blocks * BLOCK_SIZE, latent.shape[-1])
        cache[plan.cache_rows] = latent
        return cache.view(plan.num_blocks, BLOCK_SIZE, -1)

    def _decode(self, q, kv_c_normed, k_pe, plan):
        """``MLAAttention.forward_impl``'s MQA half: absorb W_UK, the CPU decode kernel, W_UV."""
        m, h = self.mla, self.num_heads
        w_uk_t, w_uv = self.absorbed.get()
        q = q.index_select(0, plan.decode_rows)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        b = q.shape[0]
        ql_nope = q.new_empty(b, h, m.kv_lora_rank)
        row_invariant_bmm(q_nope.transpose(0, 1), w_uk_t, out=ql_nope.transpose(0, 1))
        query = torch.cat((ql_nope, q_pe), dim=-1).contiguous()
        latent_out = torch.zeros(b, h, m.kv_lora_rank, dtype=q.dtype, device=q.device)
        self.decode_kernel(latent_out, query, self._latent_cache(kv_c_normed, k_pe, plan), self.scale,
                           plan.block_table, plan.decode_seq_lens)
        out = q.new_empty(b, h * m.v_head_dim)
        row_invariant_bmm(latent_out.transpose(0, 1), w_uv, out=out.view(b, h, m.v_head_dim).transpose(0, 1))
        return out

    def kernel(self, q, kv_c_normed, k_pe, plan: MlaPlan):
        out = q.new_empty(q.shape[0], self.num_heads * self.mla.v_head_dim)
        if plan.prefill_rows.numel():
            out.index_copy_(0, plan.prefill_rows, self._prefill(q, kv_c_normed, k_pe, plan))
        if plan.decode_rows.numel():
            out.index_copy_(0, plan.decode_rows, self._decode(q, kv_c_normed, k_pe, plan))
        return out


class _MLAFn(Function):
    @staticmethod
    def forward(ctx, q, kv_c_normed, k_pe, kv_b_weight, attn: AlignedMLAAttention, plan: MlaPlan):
        ctx.save_for_backward(q, kv_c_normed, k_pe, kv_b_weight)
        ctx.attn, ctx.plan = attn, plan
        return attn.kernel(q, kv_c_normed, k_pe, plan)

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        attn, m = ctx.attn, ctx.attn.mla
        with torch.enable_grad():
            inputs = [x.detach().float().requires_grad_(True) for x in saved]
            out = mla_dense_attention(*inputs, ctx.plan.seq_lens, attn.num_heads, m.qk_nope_head_dim,
                                      m.v_head_dim, attn.scale)
            grads = torch.autograd.grad(out, inputs, g.float())
        return (*(gi.to(x.dtype) for gi, x in zip(grads, saved)), None, None)
