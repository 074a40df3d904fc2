"""What ``zmrl check`` / ``zmrl bisect`` refuse before any engine or model is built.

Option values, the prompts file (line by line), whether each prompt plus its response fits
``--max-model-len``, and where the JSON result goes, each refused with a message that says what to
change; the checkpoint and adapter directories are :mod:`.checkpoint_inputs`'. See docs/diagnostics.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_MAX_MODEL_LEN = 2048
# Seeds reach numpy's generator in vLLM's workers, which takes 0 <= seed < 2**32.
MAX_SEED = 2**32 - 1
JSONL_SUFFIXES = (".jsonl", ".json")


class CheckerInputError(ValueError):
    """An input the checker cannot run with; the message says what to change."""


def require_at_least(option: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise CheckerInputError(f"{option} must be at least {minimum}, got {value}")


def require_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise CheckerInputError(f"--seed must be between 0 and {MAX_SEED}, got {seed}")


def resolve_max_model_len(config: dict, requested: int | None) -> int:
    """``requested`` (checked against the model's positions), or min(2048, the model's maximum)."""
    limit = config.get("max_position_embeddings")
    limit = limit if isinstance(limit, int) and limit > 0 else None
    if requested is None:
        return min(DEFAULT_MAX_MODEL_LEN, limit or DEFAULT_MAX_MODEL_LEN)
    require_at_least("--max-model-len", requested)
    # With rope scaling vLLM derives a longer limit itself; without, this is the model's own.
    if limit is not None and requested > limit and not config.get("rope_scaling"):
        raise CheckerInputError(
            f"--max-model-len {requested} is more than the model's max_position_embeddings ({limit}); "
            f"use at most {limit}"
        )
    return requested


def require_prompts_fit(prompts: list[list[int]], max_tokens: int, max_model_len: int) -> None:
    """Every prompt plus ``max_tokens`` response tokens within ``max_model_len``."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    need = len(prompts[longest]) + max_tokens
    if need > max_model_len:
        raise CheckerInputError(
            f"prompt {longest} has {len(prompts[longest])} tokens: with --max-tokens {max_tokens} a sequence "
            f"needs {need} positions, more than --max-model-len {max_model_len}; raise --max-model-len to "
            f"{need}, lower --max-tokens or shorten the prompt"
        )


def require_prompts_within_budget(prompts: list[list[int]], budget: int) -> None:
    """``check`` prefills each seeded prompt in one scheduler step (see ``engine.split_by_budget``)."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    if len(prompts[longest]) > budget:
        raise CheckerInputError(
            f"prompt {longest} has {len(prompts[longest])} tokens, more than the engine prefills in one "
            f"step ({budget}); shorten it to at most {budget} tokens"
        )


def require_json_destination(path: str | None) -> None:
    """``--json OUT`` must be writable before the run, not found unwritable after it."""
    if not path or path == "-":
        return
    out = Path(path)
    if out.is_dir():
        raise CheckerInputError(f"--json {out} is a directory; give a file path")
    parent = out.parent
    if not parent.is_dir():
        raise CheckerInputError(f"--json {out}: {parent} is not an existing directory")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise CheckerInputError(f"--json {out} cannot be written (no write permission)")


def _prompt_from_json_line(text: str, where: str, vocab_size: int | None):
    try:
        item = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckerInputError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(item, dict):
        raise CheckerInputError(f"{where}: expected a JSON object with \"prompt\" or \"prompt_token_ids\"")
    if "prompt_token_ids" in item:
        return _token_ids(item["prompt_token_ids"], where, vocab_size)
    if "prompt" in item:
        prompt = item["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise CheckerInputError(f"{where}: \"prompt\" must be a non-empty string, got {prompt!r}")
        return prompt
    raise CheckerInputError(f"{where}: no \"prompt\" (text) or \"prompt_token_ids\" (list of ints) key")


def _token_ids(ids, where: str, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise CheckerInputError(f"{where}: \"prompt_token_ids\" must be a non-empty list of integers")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise CheckerInputError(
            f"{where}: token ids {bad[:5]} are outside the model's vocabulary [0, {vocab_size})"
        )
    return ids


def read_prompt_file(prompts_file: str, vocab_size: int | None = None) -> list:
    """Prompt sources of a file: text (str) or token ids (list), one per non-empty line.

    ``.jsonl`` / ``.json``: one JSON object per line with ``prompt_token_ids`` (preferred when
    both are given) or ``prompt``; any other file: one text prompt per line.
    """
    path = Path(prompts_file)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CheckerInputError(f"--prompts {path} is not UTF-8 text") from None
    except OSError as error:
        raise CheckerInputError(f"--prompts {path} cannot be read: {error.strerror or error}") from None
    as_json = path.suffix in JSONL_SUFFIXES
    sources = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        sources.append(_prompt_from_json_line(line, where, vocab_size) if as_json else line)
    if not sources:
        raise CheckerInputError(f"--prompts {path} holds no prompt (every line is empty)")
    return sources
