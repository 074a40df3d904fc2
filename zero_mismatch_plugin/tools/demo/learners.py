"""The learner's forward: the aligned trainer (vLLM's kernels) or plain Hugging Face transformers,
in fp32 or in bf16 mixed precision as verl's FSDP engine runs it.

Each returns, for each response, the logprob of every sampled token under the learner's current
weights (temperature 1, no truncation: the distribution the engine sampled from), with autograd.
Only the forward differs between them; the optimizer, the loss and the weight push are shared.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

ALIGNED = "aligned"
STANDARD = "standard"
STANDARD_BF16 = "standard-bf16"
# ``zmrl demo --dtype`` -> the engine's dtype.
DTYPE_FLAGS = {"fp32": "float32", "bf16": "bfloat16"}
ENGINE_DTYPES = tuple(DTYPE_FLAGS.values())
KERNELS = (ALIGNED, STANDARD, STANDARD_BF16)


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

    def __init__(self, model_dir, max_model_len: int, engine_seed: int, dtype: str = "float32"):
        from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

        from zero_mismatch_plugin.tools.demo.engine import ENGINE_ARGS

        # The same engine arguments the engine was started with: the trainer rebuilds its config.
        self.module = AlignedCausalLM.from_pretrained(
            model_dir, max_model_len=max_model_len, seed=engine_seed, dtype=dtype, **ENGINE_ARGS
        )

    def _weights_changed(self) -> None:
        self.module.refresh_derived_weights()

    def response_logprobs(self, prompts, responses):
        from zero_mismatch_plugin.aligned import pack

        batch = pack(prompts, responses)
        return batch.split_per_sequence(self.module.token_logprobs(batch))


class LoRALearner(AlignedLearner):
    """The aligned forward over a frozen base with a trainable LoRA adapter on every linear.

    Its weights (what the optimizer updates, snapshots hold and the engine receives) are the
    adapter's A and B under PEFT's names; the engine serves each published version as a new
    adapter (vLLM's LoRA path), the base weights never move.
    """

    def __init__(self, model_dir, max_model_len: int, engine_seed: int, lora_rank: int, seed: int = 0,
                 dtype: str = "float32"):
        import tempfile
        from pathlib import Path

        from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
        from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_rank
        from zero_mismatch_plugin.aligned.lora.adapter import build_adapter

        from zero_mismatch_plugin.tools.demo.engine import ENGINE_ARGS

        with tempfile.TemporaryDirectory(prefix="zmrl-adapter-") as tmp:
            # alpha = 2r, a common choice; A and B both random so the adapter acts from version 0.
            adapter = build_adapter(Path(tmp) / "adapter", model_dir, r=lora_rank, lora_alpha=2 * lora_rank, seed=seed)
            self.module = AlignedCausalLM.from_pretrained(
                model_dir, max_model_len=max_model_len, seed=engine_seed, lora_dir=adapter, dtype=dtype,
                **ENGINE_ARGS, **lora_engine_args_for_rank(lora_rank),
            )
        self.lora_config = self.module.lora.lora_config

    def parameters(self):
        return self.module.lora.parameters()

    def named_weights(self):
        return list(self.module.lora.peft_state().items())

    def load_snapshot(self, snapshot):
        self.module.lora.load_peft_state(snapshot, where="snapshot")


class StandardLearner(Learner):
    """A plain transformers forward: same weights and math, PyTorch's own kernels."""

    kernels = STANDARD

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.module = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.module.train()  # no dropout in these configs; train() only matters for autograd bookkeeping
        if getattr(self.module.config, "tie_word_embeddings", False):
            raise ValueError("the demo's standard learner expects untied embeddings (Llama shape)")

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=ids, attention_mask=mask).logits.float()

    def _label_logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None])[:, 0]

    def response_logprobs(self, prompts, responses):
        # Right-padded batch; positions of real tokens are 0..len-1 as in the engine.
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, : lengths[i]] = torch.tensor(list(p) + list(r))
            mask[i, : lengths[i]] = 1
        logits = self._logits(ids, mask)
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            rows = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            out.append(self._label_logprobs(logits[i, rows], torch.tensor(r)))
        return out


class MixedPrecisionLearner(StandardLearner):
    """The transformers forward in bf16 mixed precision, as verl's FSDP engine trains by default.

    fp32 master weights, every forward on a bf16 copy inside ``torch.autocast(bf16)``, logprobs in
    fp32 through verl's ``logprobs_from_logits``: the mismatch against the fp32 engine is a bf16
    trainer's (docs/compare.md, "The mismatch source").
    """

    kernels = STANDARD_BF16

    def _logits(self, ids, mask):
        bf16_weights = {name: p.to(torch.bfloat16) for name, p in self.module.named_parameters()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = torch.func.functional_call(self.module, bf16_weights, (), {"input_ids": ids, "attention_mask": mask})
        return output.logits.float()

    def _label_logprobs(self, logits, labels):
        from verl.utils.torch_functional import logprobs_from_logits

        return logprobs_from_logits(logits, labels)


def make_learner(kernels: str, model_dir, max_model_len: int, engine_seed: int,
                 lora_rank: int | None = None, seed: int = 0, dtype: str = "float32") -> Learner:
    """``dtype``: the engine's, which the aligned learners compute in."""
    if lora_rank is not None:
        if kernels != ALIGNED:
            raise ValueError(f"a LoRA learner runs the aligned kernels, not {kernels!r}")
        return LoRALearner(model_dir, max_model_len, engine_seed, lora_rank, seed, dtype)
    if kernels == ALIGNED:
        return AlignedLearner(model_dir, max_model_len, engine_seed, dtype)
    if kernels == STANDARD:
        return StandardLearner(model_dir)
    if kernels == STANDARD_BF16:
        return MixedPrecisionLearner(model_dir)
    raise ValueError(f"unknown kernels {kernels!r}; expected one of {KERNELS}")
