"""Inputs of the CPU smoke run: verl's RL parquet layout, a chat template verl's agent loop can
apply, and the digit reward."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("text, expected", [("", 0.0), ("  ", 0.0), ("12 34", 1.0), ("a1", 0.5), ("seven", 0.0)])
def test_digit_reward_is_the_share_of_digit_characters(text, expected):
    from zero_mismatch_plugin.verl_cpu.digit_reward import compute_score

    assert compute_score("zmrl_digits", text, "") == expected


def test_dataset_rows_have_verls_rl_layout(tmp_path):
    import pandas as pd

    from zero_mismatch_plugin.verl_cpu.smoke_assets import DATA_SOURCE, build_smoke_dataset

    frame = pd.read_parquet(build_smoke_dataset(tmp_path, count=5))
    assert len(frame) == 5 and set(frame["data_source"]) == {DATA_SOURCE}
    first = frame.iloc[0]
    assert [m["role"] for m in first["prompt"]] == ["user"]
    assert first["prompt"][0]["content"].startswith("question: ")
    assert first["reward_model"]["style"] == "rule"
    assert list(frame["extra_info"].map(lambda e: e["index"])) == list(range(5))


def test_model_tokenizer_formats_a_chat_with_the_generation_prompt(tmp_path):
    from transformers import AutoTokenizer

    from zero_mismatch_plugin.verl_cpu.smoke_assets import build_smoke_model

    tokenizer = AutoTokenizer.from_pretrained(str(build_smoke_model(tmp_path / "model")))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "question: two"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "question: two answer:"
