"""vLLM's LoRA embedding and logits layers as trainer ops: adapters on ``embed_tokens`` and ``lm_head``.

Each runs vLLM's layer (``VocabParallelEmbeddingWithLoRA``, ``LogitsProcessorWithLoRA``), its own
forward, on the trainer's A and B in vLLM's buffer layout; the backward is fp32 torch for A and B
(and the hidden states), none for the frozen embedding or head (``docs/lora.md``).

Under tensor parallelism vLLM adds both adapters to whole rows on every rank: the embedding's
update to the rows its vocabulary-parallel lookup summed over the ranks, the logits' update to the
logits gathered from the ranks' vocabulary shards. The ops here do the same on the trainer's ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Function

from zero_mismatch_plugin.aligned.derived import DerivedWeight
from zero_mismatch_plugin.aligned.lora.adapter import LoRAAdapter
from zero_mismatch_plugin.aligned.lora.ops import TokenMapping, engine_lora_config
from zero_mismatch_plugin.aligned.lora.peft import LoRAConfig
from zero_mismatch_plugin.aligned.reductions import all_gather_parts


def _stacked_pair(lora_a, lora_b, max_rank: int, lora_dtype, scaling: float):
    """(A [max_rank, in], B [out, max_rank]) zero-padded to the engine's rank, in the LoRA dtype,
    B cast then scaled (the order of vLLM's ``LoRALayerWeights.optimize``)."""
    a = torch.zeros(max_rank, lora_a.shape[1], dtype=lora_dtype, device=lora_a.device)
    b = torch.zeros(lora_b.shape[0], max_rank, dtype=lora_dtype, device=lora_b.device)
    r = lora_a.shape[0]
    a[:r] = lora_a.to(lora_dtype)
    scaled = lora_b.to(lora_dtype, copy=True)  # never scale the parameter itself
    if scaling != 1:
        scaled *= scaling
    b[:, :r] = scaled
    return a, b


class _VocabLoRA:
    """What the embedding and the logits LoRA ops share: the engine's LoRA settings and the
    trainer's (A, B), re-derived into vLLM's buffers by :meth:`_stacked` after every step."""

    def __init__(self, runtime, pair, lora_config: LoRAConfig, mapping: TokenMapping):
        lora = engine_lora_config(runtime, lora_config.r)
        self.runtime = runtime
        self.scaling = lora_config.scaling
        self.max_rank = lora.max_lora_rank
        self.lora_dtype = lora.lora_dtype
        self.mapping = mapping
        self.params = [pair.lora_A, pair.lora_B]
        self.derived = DerivedWeight(self.params, self._build)

    def _stacked(self, sources):
        return _stacked_pair(sources[0], sources[1], self.max_rank, self.lora_dtype, self.scaling)

    def __call__(self, x):
        return _VocabLoRAFn.apply(x, self, *self.params)


class _VocabLoRAFn(Function):
    """The op's forward (vLLM's layer); its ``grads(x, A, B, g)`` (fp32) for the backward."""

    @staticmethod
    def forward(ctx, x, op: _VocabLoRA, lora_a, lora_b):
        ctx.save_for_backward(x, lora_a, lora_b)
        ctx.op = op
        return op.kernel(x)

    @staticmethod
    def backward(ctx, g):
        x, lora_a, lora_b = ctx.saved_tensors
        grad_x, grad_a, grad_b = ctx.op.grads(x, lora_a.float(), lora_b.float(), g.float())
        return grad_x, None, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype)


class _BaseEmbedding(nn.Module):
    """The frozen embedding lookup as the base layer vLLM's LoRA embedding wraps."""

    def __init__(self, lookup):
        super().__init__()
        self.lookup = lookup

    def forward(self, ids):
        return self.lookup(ids)


class AlignedLoRAEmbedding(_VocabLoRA):
    """vLLM's ``VocabParallelEmbeddingWithLoRA`` (its own forward) over the frozen embedding and
    trainable A [r, vocab], B [hidden, r] (PEFT's ``lora_embedding_A`` / ``_B``): the base rows, plus
    the rows of Aᵀ times B' added by the punica wrapper's ``add_lora_embedding`` in the model dtype.
    Backward in fp32 for A and B only."""

    def __init__(self, runtime, weight, pair, lora_config: LoRAConfig, mapping: TokenMapping):
        from vllm.lora.layers import VocabParallelEmbeddingWithLoRA

        super().__init__(runtime, pair, lora_config, mapping)
        self.weight = weight
        self.layer = VocabParallelEmbeddingWithLoRA(_BaseEmbedding(self._base))
        self._given_rows = None

    def _base(self, ids):
        if self._given_rows is not None:
            return self._given_rows
        w = self.weight
        return nn.functional.embedding(ids, w.to(self.runtime.dtype) if w.dtype != self.runtime.dtype else w)

    def over_rows(self, ids, base_rows: torch.Tensor):
        """The op on base rows already looked up (``[len(ids), hidden]``, frozen), as vLLM's layer
        under tensor parallelism adds the update to its lookup summed over the ranks."""
        self._given_rows = base_rows.detach().to(self.runtime.dtype)
        try:
            return self(ids)
        finally:
            self._given_rows = None

    def _build(self, sources):
        # vLLM's buffers: A transposed, one row per token id ([vocab, max_rank]), B [1, 1, hidden, max_rank].
        a, b = self._stacked(sources)
        return a.t().contiguous(), b[None, None]

    def kernel(self, ids):
        self.layer.lora_a_stacked_2d, self.layer.lora_b_stacked = self.derived.get()
        self.layer.punica_wrapper = self.mapping.get(ids.shape[0])
        return self.layer(ids)

    def grads(self, ids, a, b, g):
        """out = base[ids] + s (Aᵀ[ids]) Bᵀ: no gradient for the ids, A's columns at the ids."""
        g2 = g.reshape(-1, g.shape[-1])
        rows = a.t().index_select(0, ids)  # [T, r]: the A rows of the tokens
        grad_rows = (g2 @ b) * self.scaling  # [T, r]
        grad_a = torch.zeros_like(a).index_add_(1, ids, grad_rows.t())
        return None, grad_a, (g2.t() @ rows) * self.scaling


class AlignedLoRALogits(_VocabLoRA):
    """vLLM's ``LogitsProcessorWithLoRA`` (its own forward) over the frozen head of
    :class:`~zero_mismatch_plugin.aligned.ops.AlignedLogits` and trainable A [r, hidden], B [vocab, r]:
    the head's logits, then ``add_lora_logits`` (buf = h Aᵀ in fp32, logits += buf B'ᵀ), then
    soft-cap and scale. Backward in fp32 for A and B (and the hidden states), none for the frozen head.

    ``tp_group`` (None in one process): ``head`` is this rank's vocabulary shard of the head; the
    processor gathers the shards' logits in rank order before the update, as vLLM's does at tensor
    parallelism."""

    def __init__(self, runtime, head, pair, lora_config: LoRAConfig, mapping: TokenMapping, tp_group=None):
        from vllm.lora.layers import LogitsProcessorWithLoRA

        super().__init__(runtime, pair, lora_config, mapping)
        self.head = head
        self.tp_group = tp_group
        # vLLM's layer, built without its __init__ (which asks vLLM's tensor-parallel group for its
        # size), holds what that __init__ sets for a world of 1; its processor's gather is the
        # identity in one process, the ranks' shards concatenated under tensor parallelism.
        shards = 1 if self.tp_group is None else self.tp_group.size()
        processor = runtime.logits_processor(head.vocab_size * shards)
        processor._gather_logits = self._gathered
        layer = LogitsProcessorWithLoRA.__new__(LogitsProcessorWithLoRA)
        nn.Module.__init__(layer)
        layer.base_layer = processor
        layer.hidden_size, layer.dtype, layer.device = head.weight.shape[1], runtime.dtype, head.weight.device
        layer.tp_size, layer.tp_rank = 1, 0
        layer.sharded_to_full_mapping = layer.sharded_to_full_mapping_gpu = None
        self.layer = layer

    def _gathered(self, logits):
        if self.tp_group is None:
            return logits
        return torch.cat(all_gather_parts(logits, self.tp_group), dim=-1)

    def _build(self, sources):
        # vLLM's buffers: A [1, 1, max_rank, hidden], B [1, 1, vocab, max_rank].
        return tuple(t[None, None] for t in self._stacked(sources))

    def kernel(self, hidden):
        self.layer.lora_a_stacked, self.layer.lora_b_stacked = self.derived.get()
        self.layer.punica_wrapper = self.mapping.get(hidden.shape[0])
        return self.layer(self.head.derived.get(), hidden)

    def grads(self, hidden, a, b, g):
        """logits = h Wᵀ + s (h Aᵀ) Bᵀ (no soft-cap, no scale): the hidden states' gradient too."""
        if self.layer.soft_cap is not None or self.layer.scale != 1.0:
            raise NotImplementedError("logit soft-capping / scaling has no aligned backward yet")
        h32 = hidden.float()
        w32 = self.head.weight.detach().to(self.runtime.dtype).float()
        gbuf = (g @ b) * self.scaling  # [R, r]
        if self.tp_group is None:
            grad_hidden = g @ w32 + gbuf @ a
        else:
            # This rank's head rows take their columns of g. The ranks' hidden-state gradients are
            # summed (the backward of the column-parallel input); every rank computed the same
            # update, so its part is added on the first rank only. A and B: whole on every rank.
            rank, rows = torch.distributed.get_rank(self.tp_group), w32.shape[0]
            grad_hidden = g[:, rank * rows:(rank + 1) * rows] @ w32
            if rank == 0:
                grad_hidden = grad_hidden + gbuf @ a
        return grad_hidden.to(hidden.dtype), gbuf.t() @ h32, (g.t() @ (h32 @ a.t())) * self.scaling


def lora_vocab_ops(runtime, adapter: LoRAAdapter, embed_weight, head) -> dict:
    """``{"embed_tokens": AlignedLoRAEmbedding, "lm_head": AlignedLoRALogits}`` for the vocabulary
    targets the adapter has (none: empty)."""
    ops = {}
    pair = adapter.vocab_pair("embed_tokens")
    if pair is not None:
        ops["embed_tokens"] = AlignedLoRAEmbedding(runtime, embed_weight, pair, adapter.lora_config, TokenMapping(runtime))
    pair = adapter.vocab_pair("lm_head")
    if pair is not None:
        ops["lm_head"] = AlignedLoRALogits(runtime, head, pair, adapter.lora_config, TokenMapping(runtime, sampled_rows=True))
    return ops
