"""Small pieces of the Megatron face that need no engine."""

from __future__ import annotations

import torch

from zero_mismatch_plugin.faces.megatron import modules


def test_packed_lengths_are_read_once_per_batch_and_kept_on_the_batch():
    from megatron.core.packed_seq_params import PackedSeqParams

    first = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 3, 7], dtype=torch.int32))
    second = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 8], dtype=torch.int32))
    assert modules._packed_seq_lens(first) == [3, 4]  # the empty (padding) sequence is dropped
    assert modules._packed_seq_lens(second) == [2, 6]
    # Each batch keeps its own lengths: interleaved forwards do not see each other's.
    assert modules._packed_seq_lens(first) == [3, 4]
    first.cu_seqlens_q = torch.tensor([0, 5], dtype=torch.int32)  # a new tensor is read again
    assert modules._packed_seq_lens(first) == [5]
    assert not hasattr(modules, "_last_packed")


class _CountingAttention:
    def __init__(self):
        self.built = []

    def plan(self, seq_lens):
        self.built.append(list(seq_lens))
        return object()


def test_attention_plan_is_built_once_per_packed_batch_not_per_layer():
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = _CountingAttention()
    batch = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32))
    plans = [modules._batch_plan(attention, batch, [3, 4]) for _layer in range(4)]
    assert all(p is plans[0] for p in plans) and attention.built == [[3, 4]]
    # The next forward's batch builds its own (the thread count, say, may have changed since).
    again = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32))
    assert modules._batch_plan(attention, again, [3, 4]) is not plans[0]
    assert modules._batch_plan(attention, None, [8]) is not modules._batch_plan(attention, None, [8])
    assert attention.built == [[3, 4], [3, 4], [8], [8]]
