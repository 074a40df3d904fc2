"""The demo's tasks: a verifiable reward for a tiny randomly initialised model.

``digits`` (``zmrl demo``): the digit reward (:mod:`zero_mismatch_plugin.algorithms.digit_reward`)
over response tokens. ``chain`` (``zmrl demo --compare``): digits alternating odd and even. See
docs/demo.md, "The tasks".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from zero_mismatch_plugin.algorithms.digit_reward import digit_share, is_digit_piece
from zero_mismatch_plugin.tools.tiny_models import tiny_corpus

PROMPT_POOL_SIZE = 256
MAX_PROMPT_TOKENS = 12
DIGITS = "digits"
CHAIN = "chain"
TASKS = (DIGITS, CHAIN)


def _prompt_pool(tokenizer, seed: int) -> list[list[int]]:
    # A corpus seed apart from the tokenizer's, so prompts are not the tokenizer's training lines.
    return [tokenizer(f"question: {line} answer:").input_ids[-MAX_PROMPT_TOKENS:]
            for line in tiny_corpus(PROMPT_POOL_SIZE, seed=10_000 + seed)]


@dataclass
class Task:
    """Prompts and a per-response reward for one tokenizer."""

    prompts: list[list[int]]
    vocab_size: int

    def reward(self, prompt: list[int], response: list[int]) -> float:
        raise NotImplementedError

    @property
    def chance_reward(self) -> float:
        """Expected reward of a uniformly random response."""
        raise NotImplementedError

    def describe(self, response_tokens: int) -> str:
        raise NotImplementedError

    def follow_up(self, prompt_index: int, turn: int) -> list[int]:
        """The question a conversation that started with prompt ``prompt_index`` gets at ``turn``."""
        return self.prompts[(prompt_index + 7 * turn) % len(self.prompts)]

    def prompts_for_chunk(self, seed: int, chunk: int, count: int) -> list[tuple[int, list[int]]]:
        """``count`` (prompt index, prompt) pairs for rollout chunk ``chunk``, reproducible."""
        rng = random.Random(seed * 1_000_003 + chunk)
        indices = rng.sample(range(len(self.prompts)), count)
        return [(i, self.prompts[i]) for i in indices]


@dataclass
class DigitTask(Task):
    """Answer with digits: the digit reward over the response's tokens (digit tokens / response tokens)."""

    token_texts: dict[int, str] = field(default_factory=dict)  # each token id's text, decoded alone

    @classmethod
    def from_tokenizer(cls, tokenizer, seed: int = 0) -> "DigitTask":
        vocab_size = len(tokenizer)
        texts = {i: tokenizer.decode([i]) for i in range(vocab_size)}
        if not any(map(is_digit_piece, texts.values())):
            raise ValueError("the tokenizer has no digit tokens; the digit task needs some")
        return cls(prompts=_prompt_pool(tokenizer, seed), vocab_size=vocab_size, token_texts=texts)

    def reward(self, prompt: list[int], response: list[int]) -> float:
        # An id the tokenizer does not have (a model vocabulary padded past it) is no digit.
        return digit_share([self.token_texts.get(t, "") for t in response])

    @property
    def chance_reward(self) -> float:
        return digit_share(list(self.token_texts.values()))

    def describe(self, response_tokens: int) -> str:
        return f"answer with digits (reward = digit tokens / {response_tokens} response tokens)"


@dataclass
class ChainTask(Task):
    """Digits alternating odd and even: half a token's credit for a digit, half for the right parity."""

    digit_values: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_tokenizer(cls, tokenizer, seed: int = 0) -> "ChainTask":
        vocab_size = len(tokenizer)
        values = {i: int(text) for i in range(vocab_size) if is_digit_piece(text := tokenizer.decode([i]))}
        if not values or len({v % 2 for v in values.values()}) < 2:
            raise ValueError("the chain task needs odd and even digit tokens in the tokenizer")
        return cls(prompts=_prompt_pool(tokenizer, seed), vocab_size=vocab_size, digit_values=values)

    def token_credit(self, previous: int | None, token: int) -> float:
        value = self.digit_values.get(token)
        if value is None:
            return 0.0
        before = None if previous is None else self.digit_values.get(previous)
        # The first response token has no digit before it: any digit is the right parity there.
        alternates = before is None if previous is None else before is not None and (value - before) % 2 == 1
        return 0.5 + 0.5 * alternates

    def reward(self, prompt: list[int], response: list[int]) -> float:
        if not response:
            return 0.0
        previous = [None, *response[:-1]]
        return sum(self.token_credit(p, t) for p, t in zip(previous, response)) / len(response)

    @property
    def chance_reward(self) -> float:
        """Expected credit of a token after the first, for uniformly random tokens."""
        digits = len(self.digit_values) / self.vocab_size
        odd = sum(v % 2 for v in self.digit_values.values()) / len(self.digit_values)
        # 0.5 for a digit, 0.5 more for a digit after a digit of the other parity
        return 0.5 * digits + 0.5 * digits * digits * 2 * odd * (1 - odd)

    def describe(self, response_tokens: int) -> str:
        return (f"digits alternating odd and even (per token: 0.5 for a digit, 0.5 more for the other parity "
                f"than the digit before it; reward = credit / {response_tokens} response tokens)")


def make_task(name: str, tokenizer, seed: int) -> Task:
    if name == DIGITS:
        return DigitTask.from_tokenizer(tokenizer, seed=seed)
    if name == CHAIN:
        return ChainTask.from_tokenizer(tokenizer, seed=seed)
    raise ValueError(f"task must be one of {TASKS}, got {name!r}")
