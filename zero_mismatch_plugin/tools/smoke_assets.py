"""Local inputs of the CPU smoke run: a tiny model with a chat template and a tiny prompt set.

Nothing is downloaded. The model is :func:`~zero_mismatch_plugin.tools.tiny_models.build_tiny_model`'s
Llama; verl's agent loop formats every prompt with the tokenizer's chat template, which the tiny
tokenizer lacks, so a plain one is added. The prompts are the demo task's question lines, stored
as verl's RL parquet (``prompt`` as chat messages, ``data_source``, ``reward_model``).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_SOURCE = "zmrl_digits"

# One user turn in, the answer after "answer:"; enough for verl's single-turn agent loop.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} answer:{% endif %}"
)

# Smaller than the tiny default: the smoke run measures verl's plumbing, not the model.
SMOKE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def build_smoke_model(out_dir: str | Path, seed: int = 0, family: str = "llama", **shape) -> Path:
    """Build the tiny model (fp32 safetensors; a Llama unless ``family`` says otherwise) with a chat
    template; return its directory. ``shape`` overrides :data:`SMOKE_SHAPE` (e.g.
    ``num_key_value_heads=2`` for tensor parallelism 2)."""
    from transformers import AutoTokenizer

    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    out = build_tiny_model(out_dir, family=family, seed=seed, **{**SMOKE_SHAPE, **shape})
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out


def prompt_rows(count: int, seed: int = 0) -> list[dict]:
    """``count`` rows in verl's RL dataset layout, from the demo task's question lines."""
    from zero_mismatch_plugin.tools.tiny_models import tiny_corpus

    rows = []
    for index, line in enumerate(tiny_corpus(count, seed=10_000 + seed)):
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"question: {line}"}],
            "ability": "digits",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": index, "split": "train"},
        })
    return rows


def build_smoke_dataset(out_dir: str | Path, count: int = 32, seed: int = 0) -> Path:
    """Write ``train.parquet`` with ``count`` prompts; return its path."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train.parquet"
    pd.DataFrame(prompt_rows(count, seed)).to_parquet(path)
    (out / "zmrl_smoke_data.json").write_text(json.dumps({"count": count, "seed": seed}))
    return path


def smoke_input_overrides(out_dir: str | Path) -> dict[str, str]:
    """The verl overrides pointing a run at the inputs :func:`build_smoke_inputs` builds under
    ``out_dir`` (nothing is built or read here)."""
    out = Path(out_dir)
    data = out / "data" / "train.parquet"
    return {
        "actor_rollout_ref.model.path": str(out / "model"),
        "data.train_files": str(data),
        "data.val_files": str(data),
    }


def build_smoke_inputs(out_dir: str | Path, count: int = 32, seed: int = 0) -> dict[str, str]:
    """Model and dataset under ``out_dir``; the verl overrides that point a run at them."""
    out = Path(out_dir)
    build_smoke_model(out / "model", seed=seed)
    build_smoke_dataset(out / "data", count=count, seed=seed)
    return smoke_input_overrides(out)


if __name__ == "__main__":
    import sys

    for key, value in build_smoke_inputs(sys.argv[1] if len(sys.argv) > 1 else "zmrl-smoke-inputs").items():
        print(f"{key}={value}")
