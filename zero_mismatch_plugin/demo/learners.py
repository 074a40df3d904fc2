"""The learner's forward: the aligned trainer (vLLM's kernels) or plain Hugging Face transformers.

Both return, for each response, the logprob of every sampled token under the learner's current
weights (temperature 1, no truncation: the distribution the engine sampled from), with autograd.
Only the forward differs between them; the optimizer, the loss and the weight push are shared.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

ALIGNED = "aligned"
STANDARD = "standard"
KERNELS = (ALIGNED, STANDARD)


class Learner:
    """Common parts: named weights under checkpoint names, temporary weight swaps."""

    kernels: str
    module: torch.nn.Module

    def parameters(self):
        return self.module.parameters()

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, fp32 tensor) pairs, detached: what the engine loads."""
        return [(name, p.detach()) for name, p in self.module.named_parameters()]

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.named_weights()}

    def load_snapshot(self, snapshot: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                p.copy_(snapshot[name])
        self._weights_changed()

    @contextlib.contextmanager
    def weights_of(self, snapshot: dict[str, torch.Tensor]) -> Iterator[None]:
        """Run the block with ``snapshot``'s weights; the current weights come back bit for bit."""
        current = self.snapshot()
        self.load_snapshot(snapshot)
        try:
            yield
        finally:
            self.load_snapshot(current)

    def _weights_changed(self) -> None:
        pass

    def response_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        raise NotImplementedError


class AlignedLearner(Learner):
    """``AlignedCausalLM``: vLLM's own kernels in the forward, analytic backward."""

    kernels = ALIGNED

    def __init__(self, model_dir, max_model_len: int, engine_seed: int):
        from zero_mismatch_plugin.aligned import AlignedCausalLM

        # The same engine arguments the engine was started with: the trainer rebuilds its config.
        self.module = AlignedCausalLM.from_pretrained(model_dir, max_model_len=max_model_len, seed=engine_seed)

    def _weights_changed(self) -> None:
        self.module.refresh_derived_weights()

    def response_logprobs(self, prompts, responses):
        from zero_mismatch_plugin.aligned import pack

        batch = pack(prompts, responses)
        return batch.split_per_sequence(self.module.token_logprobs(batch))


class StandardLearner(Learner):
    """A plain transformers forward: same weights and math, PyTorch's own kernels."""

    kernels = STANDARD

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.module = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.module.train()  # no dropout in these configs; train() only matters for autograd bookkeeping
        if getattr(self.module.config, "tie_word_embeddings", False):
            raise ValueError("the demo's standard learner expects untied embeddings (Llama shape)")

    def response_logprobs(self, prompts, responses):
        # Right-padded batch; positions of real tokens are 0..len-1 as in the engine.
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, : lengths[i]] = torch.tensor(list(p) + list(r))
            mask[i, : lengths[i]] = 1
        logits = self.module(input_ids=ids, attention_mask=mask).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            rows = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            out.append(logprobs[i, rows].gather(-1, torch.tensor(r)[:, None])[:, 0])
        return out


def make_learner(kernels: str, model_dir, max_model_len: int, engine_seed: int) -> Learner:
    if kernels == ALIGNED:
        return AlignedLearner(model_dir, max_model_len, engine_seed)
    if kernels == STANDARD:
        return StandardLearner(model_dir)
    raise ValueError(f"unknown kernels {kernels!r}; expected one of {KERNELS}")
