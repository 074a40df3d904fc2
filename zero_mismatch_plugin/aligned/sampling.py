"""The engine's sampling transform, reproduced on the trainer's logits.

Reproduces the logprob vLLM records under its ``logprobs_mode`` (raw, or processed with the
engine's top-k/top-p mask replayed) and refuses what cannot be reproduced. See
docs/zero-mismatch.md, "Sampling parity".
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

RAW = "raw_logprobs"
PROCESSED = "processed_logprobs"


class ZeroMismatchViolation(RuntimeError):
    """A sampling configuration under which the trainer cannot reproduce the engine's μ."""


@dataclass(frozen=True)
class SamplingTransform:
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    logprobs_mode: str = PROCESSED
    # Recompute vLLM's top-k/top-p mask on the trainer's logits. The logits are the engine's
    # bits, so vLLM's own mask function yields the engine's mask.
    replay_mask: bool = True

    @property
    def truncates(self) -> bool:
        return (self.top_k not in (0, -1, None)) or self.top_p < 1.0

    def problems(self) -> list[str]:
        out = []
        if self.logprobs_mode not in (RAW, PROCESSED):
            out.append(f"logprobs_mode {self.logprobs_mode!r} does not record a logprob")
        if self.temperature <= 0:
            out.append("temperature 0 is greedy decoding: there is no sampling distribution μ")
        if self.logprobs_mode == RAW and (self.temperature != 1.0 or self.truncates):
            out.append(
                "raw_logprobs records log_softmax of unscaled, untruncated logits, but tokens "
                f"were sampled at T={self.temperature}, top_k={self.top_k}, top_p={self.top_p}: "
                "μ is not the sampling distribution (use processed_logprobs, or T=1 and no "
                "truncation)"
            )
        if self.logprobs_mode == PROCESSED and self.truncates and not self.replay_mask:
            out.append(
                "top-k/top-p truncation without replaying the engine's mask: the trainer's "
                "distribution is not the one sampled from"
            )
        return out

    def check(self, strict: bool = True) -> None:
        problems = self.problems()
        if not problems:
            return
        message = "zero mismatch is not possible: " + "; ".join(problems)
        if strict:
            raise ZeroMismatchViolation(message)
        logger.error(message)
        warnings.warn(message, stacklevel=2)

    @classmethod
    def from_sampling_params(cls, params, logprobs_mode: str = PROCESSED, replay_mask=True):
        """Build from ``vllm.SamplingParams``; refuse settings no transform here reproduces."""
        unsupported = []
        if getattr(params, "repetition_penalty", 1.0) != 1.0:
            unsupported.append("repetition_penalty")
        if getattr(params, "frequency_penalty", 0.0) != 0.0:
            unsupported.append("frequency_penalty")
        if getattr(params, "presence_penalty", 0.0) != 0.0:
            unsupported.append("presence_penalty")
        if getattr(params, "min_p", 0.0) not in (0.0, None):
            unsupported.append("min_p")
        if getattr(params, "logit_bias", None):
            unsupported.append("logit_bias")
        if getattr(params, "bad_words", None):
            unsupported.append("bad_words")
        if getattr(params, "allowed_token_ids", None):
            unsupported.append("allowed_token_ids")
        if getattr(params, "min_tokens", 0):
            # Masks the stop tokens until min_tokens are out: changes the processed μ.
            unsupported.append("min_tokens")
        if unsupported and logprobs_mode == PROCESSED:
            raise ZeroMismatchViolation(
                "the aligned sampling transform does not replay: " + ", ".join(unsupported)
            )
        return cls(
            temperature=float(params.temperature),
            top_k=int(params.top_k or 0),
            top_p=float(params.top_p),
            logprobs_mode=logprobs_mode,
            replay_mask=replay_mask,
        )

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logprobs of what the engine recorded, differentiable in ``logits``."""
        if self.logprobs_mode == RAW:
            return vllm_logprobs(logits)
        logits = vllm_scaled_logits(logits, self.temperature if self.temperature != 1.0 else None)
        if self.truncates and self.replay_mask:
            logits = logits.masked_fill(self.engine_mask(logits), float("-inf"))
        return vllm_logprobs(logits)

    def engine_mask(self, scaled_logits: torch.Tensor) -> torch.Tensor:
        """True where vLLM's top-k/top-p sets a logit to -inf."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        rows = scaled_logits.shape[0]
        k = None
        p = None
        if self.top_k not in (0, -1, None):
            k = torch.full((rows,), self.top_k, dtype=torch.int32, device=scaled_logits.device)
        if self.top_p < 1.0:
            p = torch.full((rows,), self.top_p, dtype=torch.float32, device=scaled_logits.device)
        with torch.no_grad():
            masked = apply_top_k_top_p(scaled_logits.detach().clone(), k, p)
        return torch.isneginf(masked) & ~torch.isneginf(scaled_logits.detach())


# ----- The logprob tail: the one place the trainer, both faces, the checker and the demo turn
# logits into the logprob vLLM records ------------------------------------------------------


def vllm_scaled_logits(logits: torch.Tensor, temperature=None) -> torch.Tensor:
    """fp32 logits divided by the fp32 temperature (a float, or one per row), as vLLM's sampler
    divides them (``apply_temperature``); ``None``: T = 1, no division."""
    scaled = logits.to(torch.float32)
    if temperature is None:
        return scaled
    if isinstance(temperature, torch.Tensor):
        return scaled / temperature.to(torch.float32).unsqueeze(-1)
    return scaled / torch.tensor([temperature], dtype=torch.float32, device=scaled.device)


def vllm_logprobs(scaled_logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logprobs as vLLM's sampler computes them (``Sampler.compute_logprobs``)."""
    from vllm.v1.sample.sampler import Sampler

    return Sampler.compute_logprobs(scaled_logits)


def gather_labels(logprobs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The logprob of each label: ``logprobs[..., label]``."""
    return logprobs.gather(-1, labels.to(logprobs.device).unsqueeze(-1).long()).squeeze(-1)


def vllm_label_logprobs(logits, labels, temperature=None) -> torch.Tensor:
    """vLLM's sampler logprob of each label at a temperature (a float or one per row)."""
    return gather_labels(vllm_logprobs(vllm_scaled_logits(logits, temperature)), labels)


def recorded_logprobs(logits, labels, transform: SamplingTransform | None = None, strict=True):
    """The logprob the engine recorded for each label (one logits row per label), under the
    engine's sampling ``transform`` (default: T = 1, no truncation); refuses a transform under
    which the trainer cannot reproduce it (``strict=False``: reports it loudly)."""
    transform = transform or SamplingTransform()
    transform.check(strict=strict)
    return gather_labels(transform.logprobs(logits), labels)
