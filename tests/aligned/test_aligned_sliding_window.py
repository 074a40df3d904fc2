"""Sliding-window attention (Mistral, every layer windowed), both trainer faces, prefix caching on.

The window (12 tokens) is shorter than most prompts and than every prompt + response, so it is
crossed inside prompts and inside responses. Conversations are re-sent whole over three turns with
the engine's default 128-token KV blocks, so later turns take more than the window from the prefix
cache. The weight-changing test goes last.
"""

from __future__ import annotations

import pytest
import torch

import aligned_checks as checks
from vllm_session import hf_token_logprobs

from zero_mismatch_plugin.aligned import pack

NAME = "mistral_window"
WINDOW = 12
SEED = 700


@pytest.fixture(scope="module")
def conversations(engines, checkpoints):
    return checks.windowed_conversations(engines, checkpoints, NAME, seed=SEED)


def test_every_layer_gets_the_window(engines, trainers):
    trainer = trainers(NAME)
    assert trainer.blocks.sliding_windows == (WINDOW,) * trainer.config.num_hidden_layers
    assert {a.sliding_window for a in trainer.layer_attention} == {WINDOW}
    assert {a.kernel.layer.impl.sliding_window for a in trainer.layer_attention} == {WINDOW}
    llm = engines.get(NAME)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


def test_windows_crossed_and_prefix_hits_past_the_window(conversations):
    _, turns, prompts, responses, _ = conversations
    assert all(len(p) > WINDOW for p in turns[0][0])  # crossed inside prompts
    assert all(len(p) + len(r) > WINDOW + len(r) // 2 for p, r in zip(prompts, responses))
    for _, _, _, cached in turns[1:]:
        # Hits reach well past the window (whole 128-token blocks) for most conversations. (A block
        # filled only by the previous turn's response was not hit on the next turn here.)
        assert sum(c >= 128 for c in cached) >= len(cached) // 2, cached
    print(f"cached prompt tokens per turn: {[sum(t[3]) for t in turns]} of {[sum(map(len, t[0])) for t in turns]}")


def test_aligned_model_bitwise_equal_engine(conversations, trainers):
    _, _, prompts, responses, mu = conversations
    with torch.no_grad():
        logprobs = trainers(NAME).token_logprobs(pack(prompts, responses))
    assert torch.equal(logprobs, mu), checks.bitwise_report("aligned model", logprobs, mu)


def test_megatron_face_bitwise_equal_engine(conversations, checkpoints):
    from zero_mismatch_plugin.megatron.modules import AlignedCoreAttention
    from zero_mismatch_plugin.megatron.standalone import build_gpt_model

    _, _, prompts, responses, mu = conversations
    logprobs, model, runtime = checks.megatron_face_logprobs(checkpoints[NAME], prompts, responses)
    assert model.config.window_size == (WINDOW - 1, 0)
    cores = [m for m in model.modules() if isinstance(m, AlignedCoreAttention)]
    assert [c.sliding_window for c in cores] == [WINDOW] * len(cores) and cores
    assert torch.equal(logprobs, mu), checks.bitwise_report("megatron face", logprobs, mu)
    # A megatron config without the checkpoint's window (a provider that dropped it) is refused.
    with pytest.raises(NotImplementedError, match="sliding window None in megatron's config but 12"):
        build_gpt_model(runtime, aligned=True, load=False, window_size=None)


def test_prefix_hit_equals_miss_across_the_window(conversations):
    llm, turns, *_ = conversations
    checks.check_prefix_hit_equals_miss(llm, turns, seed=SEED, min_cached=WINDOW)


def test_transformers_is_close_but_not_the_engine_bits(conversations, trainers):
    """Negative control: transformers' Mistral (same window) is close to μ, not μ; without the
    window it is far, so the window is exercised."""
    _, _, prompts, responses, mu = conversations
    trainer = trainers(NAME)
    with torch.no_grad():
        model = checks.hf_model(trainer, torch.float32)
        windowed = hf_token_logprobs(model, prompts, responses)
        model.config.sliding_window = None
        full = hf_token_logprobs(model, prompts, responses)
    close = (windowed - mu).abs().max().item()
    print(f"transformers fp32: {(windowed == mu).float().mean().item():.1%} bitwise equal, max |diff| {close:.3g}; "
          f"without the window max |diff| {(full - mu).abs().max().item():.3g}")
    assert close < 1e-4
    assert not torch.equal(windowed, mu)
    assert (full - mu).abs().max().item() > 1e-3


def test_custom_backward_matches_float64_autograd(engines, trainers):
    worst = checks.check_backward_matches_float64(trainers(NAME), engines, NAME)
    print(f"{NAME}: worst relative gradient error vs float64 {worst:.3g}")


def test_equal_again_after_optimizer_step_and_weight_sync(engines, trainers):
    checks.check_update_and_sync(engines, trainers, NAME)
