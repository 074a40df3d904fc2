"""``zmrl demo --turns N``: multi-turn conversations re-sent whole, answered from the prefix cache,
and every token, scored with the weights that sampled it, still the engine's bits."""

from __future__ import annotations

import pytest

from vllm_session import demo_llama_engine
from zero_mismatch_plugin.demo import DemoConfig, run_demo

MAX_MODEL_LEN = 128
TURNS = 3


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    """(engine, model directory) in consistent numerics; the variables are restored afterwards."""
    yield from demo_llama_engine(tmp_path_factory, "demo_turns_model", MAX_MODEL_LEN)


def test_turns_hit_the_prefix_cache_and_every_token_stays_bitwise(demo_engine):
    engine, model_dir = demo_engine
    config = DemoConfig(max_model_len=MAX_MODEL_LEN, updates=4, lag=1, turns=TURNS, seed=3)
    result = run_demo(config, engine, model_dir)
    per_update = config.prompts_per_update * config.samples_per_prompt * TURNS
    cached = 0
    for record in result.records:
        assert len(record.sample_versions) == per_update
        # Scored with the weights that sampled it, every sample of every turn is the engine's bits.
        assert all(own is True for own in record.own_version_bitwise), record.own_version_bitwise
        assert record.metrics["demo/own_version/bitwise_equal_fraction"] == 1.0
        cached += record.metrics["demo/prefix_cache/cached_prompt_tokens"]
    # Conversations of 2 and 3 turns are longer than one 32-token block: hits must have happened.
    assert cached >= 32 * len(result.records), cached
    print(f"{cached:.0f} prompt tokens from the prefix cache over {len(result.records)} updates")


def test_turns_that_do_not_fit_are_refused_clearly():
    with pytest.raises(ValueError, match="--turns 6: a conversation reaches 168 tokens, more than max_model_len=128"):
        DemoConfig(max_model_len=128, turns=6)
    with pytest.raises(ValueError, match="--turns must be at least 1"):
        DemoConfig(turns=0)
