"""The demo's tasks: a verifiable reward for a tiny randomly initialised model.

Prompts are short question-like lines from the tiny corpus. Two rewards, both in [0, 1] with
partial credit per token:

- ``digits`` (``zmrl demo``): the fraction of response tokens that are digit tokens (tokens that
  decode to digits, optionally after a space). A random model starts near chance (about 36 of
  512 tokens) and learns it within a few hundred small updates by moving probability onto those
  tokens: one global shift, so it saturates early.
- ``chain`` (``zmrl demo --compare``): digits alternating odd and even. A response token earns
  half its credit for being a digit token and the other half for having the other parity than
  the digit token before it (the first token: for any digit). The first half is the digit task's
  global shift; the second depends on the token before, a mapping the model has to learn over
  the digit tokens, so the reward keeps climbing after the digit half is learnt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from zero_mismatch_plugin.tools.tiny_models import tiny_corpus

PROMPT_POOL_SIZE = 256
MAX_PROMPT_TOKENS = 12
DIGITS = "digits"
CHAIN = "chain"
TASKS = (DIGITS, CHAIN)


def is_digit_text(text: str) -> bool:
    stripped = text.strip()
    return bool(stripped) and stripped.isdigit() and text.lstrip(" ") == stripped


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
    """Answer with digits: reward = digit tokens / response tokens."""

    digit_token_ids: frozenset[int] = frozenset()

    @classmethod
    def from_tokenizer(cls, tokenizer, seed: int = 0) -> "DigitTask":
        vocab_size = len(tokenizer)
        digit_ids = frozenset(i for i in range(vocab_size) if is_digit_text(tokenizer.decode([i])))
        if not digit_ids:
            raise ValueError("the tokenizer has no digit tokens; the digit task needs some")
        return cls(prompts=_prompt_pool(tokenizer, seed), vocab_size=vocab_size, digit_token_ids=digit_ids)

    def reward(self, prompt: list[int], response: list[int]) -> float:
        if not response:
            return 0.0
        return sum(t in self.digit_token_ids for t in response) / len(response)

    @property
    def chance_reward(self) -> float:
        return len(self.digit_token_ids) / self.vocab_size

    def describe(self, response_tokens: int) -> str:
        return f"answer with digits (reward = digit tokens / {response_tokens} response tokens)"


@dataclass
class ChainTask(Task):
    """Digits alternating odd and even: half a token's credit for a digit, half for the right parity."""

    digit_values: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_tokenizer(cls, tokenizer, seed: int = 0) -> "ChainTask":
        vocab_size = len(tokenizer)
        values = {i: int(text) for i in range(vocab_size) if is_digit_text(text := tokenizer.decode([i]))}
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
