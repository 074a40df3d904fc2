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
from vllm_session import hf_token_logprobs, multi_turn_rollout, prompts_for

from zero_mismatch_plugin.aligned import pack

NAME = "mistral_window"
WINDOW = 12


def _conversations(engines, checkpoints, seed):
    """Three turns of 8 conversations; the first prompts are 110..145 tokens, so every later
    prompt is longer than one 128-token block."""
    llm = engines.get(NAME)
    pieces = prompts_for(checkpoints[NAME], num_prompts=8, corpus_seed=41)
    text = sum(pieces * 4, [])
    first = [text[7 * i : 7 * i + 110 + 5 * i] for i in range(8)]
    follow_ups = [prompts_for(checkpoints[NAME], num_prompts=8, corpus_seed=50 + t) for t in range(2)]
    llm.reset_prefix_cache()
    return llm, multi_turn_rollout(llm, first, follow_ups, seed=seed)


@pytest.fixture(scope="module")
def conversations(engines, checkpoints):
    llm, turns = _conversations(engines, checkpoints, seed=700)
    prompts = [p for t in turns for p in t[0]]
    responses = [r for t in turns for r in t[1]]
    mu = torch.cat([t[2] for t in turns])
    return llm, turns, prompts, responses, mu


def _report(name, logprobs, mu):
    equal = (logprobs == mu).float().mean().item()
    return f"{name}: {equal:.1%} of {mu.numel()} tokens bitwise equal, max |diff| {(logprobs - mu).abs().max().item():.3g}"


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
    assert torch.equal(logprobs, mu), _report("aligned model", logprobs, mu)


def test_megatron_face_bitwise_equal_engine(conversations, checkpoints):
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.megatron.modules import AlignedCoreAttention
    from zero_mismatch_plugin.megatron.standalone import (
        build_gpt_model,
        init_single_process,
        packed_logits,
        token_logprobs_from_logits,
    )

    _, _, prompts, responses, mu = conversations
    init_single_process()
    runtime = VllmRuntime(checkpoints[NAME], max_model_len=256, seed=0)
    model = build_gpt_model(runtime, aligned=True).eval()
    assert model.config.window_size == (WINDOW - 1, 0)
    cores = [m for m in model.modules() if isinstance(m, AlignedCoreAttention)]
    assert [c.sliding_window for c in cores] == [WINDOW] * len(cores) and cores
    batch = pack(prompts, responses)
    with torch.no_grad():
        logprobs = token_logprobs_from_logits(packed_logits(model, batch), batch)
    assert torch.equal(logprobs, mu), _report("megatron face", logprobs, mu)
    # A megatron config without the checkpoint's window (a provider that dropped it) is refused.
    with pytest.raises(NotImplementedError, match="sliding window None in megatron's config but 12"):
        build_gpt_model(runtime, aligned=True, load=False, window_size=None)


def test_prefix_hit_equals_miss_across_the_window(conversations):
    """The last turn again with an empty cache, same seeds: tokens and logprobs identical."""
    llm, turns, *_ = conversations
    prompts, responses, mu, cached = turns[-1]
    llm.reset_prefix_cache()
    miss_prompts, miss_responses, miss_mu, miss_cached = multi_turn_rollout(llm, prompts, [], seed=700 + 2000)[0]
    assert min(cached) > WINDOW and miss_cached == [0] * len(prompts)
    assert miss_responses == responses
    assert torch.equal(miss_mu, mu)


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
