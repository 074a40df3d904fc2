"""Packed (varlen) teacher-forced batches: prompt + response per sequence, no padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] all sequences back to back
    positions: torch.Tensor  # [T] position within its own sequence
    seq_lens: list[int]
    target_rows: torch.Tensor  # [R] rows whose next-token logits score a response token
    target_ids: torch.Tensor  # [R] the response tokens, in sequence order
    response_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def split_per_sequence(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a [R] per-response-token tensor into one tensor per sequence."""
        return list(values.split(self.response_lens))

    def to(self, device) -> "PackedBatch":
        return PackedBatch(
            self.input_ids.to(device),
            self.positions.to(device),
            self.seq_lens,
            self.target_rows.to(device),
            self.target_ids.to(device),
            self.response_lens,
        )


def split_sequences(batch: PackedBatch, parts: int) -> list[PackedBatch]:
    """``batch``'s sequences in ``parts`` consecutive groups (sizes differing by at most one),
    each packed on its own; their response tokens, in order, are ``batch``'s."""
    count = len(batch.seq_lens)
    if not 1 <= parts <= count:
        raise ValueError(f"{count} sequences cannot be split into {parts} non-empty groups")
    sequences = batch.input_ids.split(batch.seq_lens)
    prompts = [seq[: len(seq) - n].tolist() for seq, n in zip(sequences, batch.response_lens)]
    responses = [seq[len(seq) - n:].tolist() for seq, n in zip(sequences, batch.response_lens)]
    per, extra = divmod(count, parts)
    out, start = [], 0
    for part in range(parts):
        stop = start + per + (part < extra)
        out.append(pack(prompts[start:stop], responses[start:stop]))
        start = stop
    return out


def pack(prompts: list[list[int]], responses: list[list[int]]) -> PackedBatch:
    """Pack prompt+response token lists; targets are the response tokens."""
    if len(prompts) != len(responses):
        raise ValueError("one response per prompt")
    ids, positions, seq_lens, rows, targets, response_lens = [], [], [], [], [], []
    offset = 0
    for prompt, response in zip(prompts, responses):
        if not prompt:
            raise ValueError("every sequence needs at least one prompt token")
        seq = list(prompt) + list(response)
        ids.extend(seq)
        positions.extend(range(len(seq)))
        seq_lens.append(len(seq))
        # The logits at row (len(prompt) - 1 + j) are the distribution of response[j].
        rows.extend(offset + len(prompt) - 1 + j for j in range(len(response)))
        targets.extend(response)
        response_lens.append(len(response))
        offset += len(seq)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        seq_lens=seq_lens,
        target_rows=torch.tensor(rows, dtype=torch.long),
        target_ids=torch.tensor(targets, dtype=torch.long),
        response_lens=response_lens,
    )
