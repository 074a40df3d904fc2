"""``zmrl demo --turns N``: multi-turn conversations re-sent whole, answered from the prefix cache,
and every token, scored with the weights that sampled it, still the engine's bits."""

from __future__ import annotations

import pytest

from support.vllm_session import demo_llama_engine
from zero_mismatch_plugin.tools.demo import DemoConfig, run_demo

# Room for the longest conversation this host keeps bitwise (224 tokens with a 512 KiB L2) and one more turn.
MAX_MODEL_LEN = 256
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


def _host_bound():
    from zero_mismatch_plugin.tools.demo.runner import conversation_tokens, demo_bitwise_context_tokens

    bound = demo_bitwise_context_tokens()
    if bound is None:
        pytest.skip("the host's attention kernel is not vLLM's VEC kernel: no known bitwise length")
    return bound, conversation_tokens(1, DemoConfig.response_tokens)


def _small(**overrides):
    """Two conversations of two samples per chunk: the same turns, an eighth of the samples."""
    return DemoConfig(max_model_len=MAX_MODEL_LEN, prompts_per_update=2, samples_per_prompt=2, lag=0, **overrides)


def test_vec_kernel_tile_arithmetic_gives_the_measured_bound():
    """vLLM's VEC attention with this model's heads (64 dims, 2 query heads per KV head): 224 tokens
    with 512 KiB of L2 (measured: rows past 224 differ between a full forward and decode steps)."""
    from zero_mismatch_plugin.tools.demo.attention_limits import vec_kernel_bitwise_tokens

    assert vec_kernel_bitwise_tokens(512 * 1024, 64, 2) == 224
    assert vec_kernel_bitwise_tokens(256 * 1024, 64, 2) == 128
    assert vec_kernel_bitwise_tokens(2 * 1024 * 1024, 64, 2) == 992


def _run_with_samples(engine, model_dir, config):
    """The run, and (sample, own-version bitwise) for every sample it trained on."""
    from zero_mismatch_plugin.tools.demo import DemoRun

    run = DemoRun(config, engine, model_dir)
    seen = []
    update = run._update

    def recording_update(step, chunks, waited):
        record = update(step, chunks, waited)
        seen.extend(zip([s for c in chunks for s in c.samples], record.own_version_bitwise))
        return record

    run._update = recording_update
    return run.run(), seen


def test_the_longest_conversation_the_host_allows_stays_bitwise(demo_engine):
    engine, model_dir = demo_engine
    bound, per_turn = _host_bound()
    turns = min(bound, MAX_MODEL_LEN) // per_turn
    result, seen = _run_with_samples(engine, model_dir, _small(updates=1, turns=turns, seed=3))
    longest = max(len(s.prompt) + len(s.response) for s, _ in seen)
    assert longest > (turns - 1) * per_turn, longest  # the last turn reaches past the turn before's bound
    assert all(own is True for _, own in seen)
    assert all(all(r.ratios_all_one) for r in result.records)


def test_one_turn_past_the_bound_is_refused_and_would_not_stay_bitwise(demo_engine, monkeypatch):
    """The smallest reproducing setting (``--turns 9`` on a 512 KiB-L2 host: its ninth turn's rows pass
    224 tokens) is refused up front; forced through, only sequences past the bound lose the engine's bits."""
    engine, model_dir = demo_engine
    bound, per_turn = _host_bound()
    turns = bound // per_turn + 1
    if turns * per_turn > MAX_MODEL_LEN:
        pytest.skip(f"{turns} turns do not fit this test's engine ({MAX_MODEL_LEN} tokens)")
    with pytest.raises(ValueError, match=rf"--turns {turns}: a conversation reaches {turns * per_turn} tokens, more "
                                         rf"than the {bound} tokens this host's vLLM CPU attention keeps bitwise"):
        _small(updates=1, turns=turns)
    _small(updates=1, turns=turns, kernels="standard")  # no bitwise claim, no bound

    monkeypatch.setattr("zero_mismatch_plugin.tools.demo.runner.demo_bitwise_context_tokens", lambda: None)
    _, seen = _run_with_samples(engine, model_dir, _small(updates=1, turns=turns, seed=3))
    lengths_not_bitwise = [len(s.prompt) + len(s.response) for s, own in seen if not own]
    assert lengths_not_bitwise, "past the bound some sample must lose the engine's bits"
    assert min(lengths_not_bitwise) > bound, lengths_not_bitwise
