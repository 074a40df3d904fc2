"""The demo's task: answer with digits.

Prompts are short question-like lines from the tiny corpus. The reward of a response is the
fraction of its tokens that are digit tokens (tokens that decode to digits, optionally after a
space): a verifiable score in [0, 1] with a dense signal, which a randomly initialised model
starts near chance on (about 36 of 512 tokens) and can learn within a few hundred small
updates by moving probability onto those tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from zero_mismatch_plugin.tiny_models import tiny_corpus

PROMPT_POOL_SIZE = 256
MAX_PROMPT_TOKENS = 12


def is_digit_text(text: str) -> bool:
    stripped = text.strip()
    return bool(stripped) and stripped.isdigit() and text.lstrip(" ") == stripped


@dataclass
class DigitTask:
    """Prompts and the digit-fraction reward for one tokenizer."""

    prompts: list[list[int]]
    digit_token_ids: frozenset[int]
    vocab_size: int

    @classmethod
    def from_tokenizer(cls, tokenizer, seed: int = 0) -> "DigitTask":
        vocab_size = len(tokenizer)
        digit_ids = frozenset(i for i in range(vocab_size) if is_digit_text(tokenizer.decode([i])))
        if not digit_ids:
            raise ValueError("the tokenizer has no digit tokens; the digit task needs some")
        prompts = []
        # A corpus seed apart from the tokenizer's, so prompts are not the tokenizer's training lines.
        for line in tiny_corpus(PROMPT_POOL_SIZE, seed=10_000 + seed):
            ids = tokenizer(f"question: {line} answer:").input_ids[-MAX_PROMPT_TOKENS:]
            prompts.append(ids)
        return cls(prompts=prompts, digit_token_ids=digit_ids, vocab_size=vocab_size)

    def reward(self, response: list[int]) -> float:
        if not response:
            return 0.0
        return sum(t in self.digit_token_ids for t in response) / len(response)

    @property
    def chance_reward(self) -> float:
        """Expected reward of a uniformly random response."""
        return len(self.digit_token_ids) / self.vocab_size

    def prompts_for_chunk(self, seed: int, chunk: int, count: int) -> list[tuple[int, list[int]]]:
        """``count`` (prompt index, prompt) pairs for rollout chunk ``chunk``, reproducible."""
        rng = random.Random(seed * 1_000_003 + chunk)
        indices = rng.sample(range(len(self.prompts)), count)
        return [(i, self.prompts[i]) for i in indices]
