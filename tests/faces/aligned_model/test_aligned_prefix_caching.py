"""Prefix caching in consistent mode: a cache hit gives the bits of a miss, and the trainer's.

Multi-turn conversations re-send the whole conversation every turn, so from the second turn on the
engine takes the earlier turns' KV blocks from its cache and computes only the rest of the prompt.
KV blocks of 32 tokens here (the smallest vLLM's CPU attention takes; its default is 128) put many
block boundaries inside prompts and responses, and most prompts end in a partially filled block.
"""

from __future__ import annotations

import pytest
import torch

from support.vllm_session import MAX_MODEL_LEN, multi_turn_rollout, prompts_for

from zero_mismatch_plugin.aligned import pack

BLOCK_SIZE = 32
TURNS = 4  # the first prompt and three follow-ups


@pytest.fixture(scope="module")
def llama_block32(checkpoints, engines):
    """An engine with 32-token KV blocks and prefix caching as consistent mode decides it, and the
    trainer built with the same engine arguments."""
    from vllm import LLM

    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    engines.pool.make_room()  # room for the engine started here
    kwargs = dict(max_model_len=MAX_MODEL_LEN, seed=0, block_size=BLOCK_SIZE)
    llm = LLM(**engine_args_for(checkpoints["llama"], **kwargs))
    trainer = AlignedCausalLM.from_pretrained(checkpoints["llama"], **kwargs)
    yield llm, trainer
    shutdown_engine(llm)


def _conversation_inputs(checkpoint):
    """First prompts of 25..55 tokens and 3 follow-ups of 4..15 user tokens per conversation."""
    pieces = prompts_for(checkpoint, num_prompts=8, corpus_seed=21)
    first = [sum((pieces[(i + j) % 8] for j in range(3 + i % 3)), []) for i in range(8)]
    follow_ups = [prompts_for(checkpoint, num_prompts=8, corpus_seed=30 + t) for t in range(TURNS - 1)]
    return first, follow_ups


def test_consistent_mode_keeps_prefix_caching_on_for_dense_decoders(llama_block32):
    llm, _ = llama_block32
    cache = llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching and cache.block_size == BLOCK_SIZE


def test_multi_turn_hits_equal_misses_and_the_trainer(llama_block32, checkpoints):
    llm, trainer = llama_block32
    first, follow_ups = _conversation_inputs(checkpoints["llama"])
    llm.reset_prefix_cache()
    turns = multi_turn_rollout(llm, first, follow_ups, seed=500)

    # Hits happened on every follow-up turn, whole blocks each, past several block boundaries.
    _, _, _, cached_first = turns[0]
    assert cached_first == [0] * len(first)
    for prompts, _, _, cached in turns[1:]:
        assert all(c > 0 and c % BLOCK_SIZE == 0 for c in cached), cached
        assert all(c < len(p) for c, p in zip(cached, prompts)), "a prompt must have tokens past its hit"
    last_prompts, last_responses, last_mu, last_cached = turns[-1]
    assert max(last_cached) >= 3 * BLOCK_SIZE
    partial = sum(len(p) % BLOCK_SIZE != 0 for prompts, *_ in turns for p in prompts)
    assert partial >= len(turns) * len(first) // 2, "most prompts end inside a block"
    print(f"cached prompt tokens per turn: {[sum(t[3]) for t in turns]} of {[sum(map(len, t[0])) for t in turns]}")

    # Trainer == engine on every turn (first turn misses, later turns hits).
    all_prompts = [p for prompts, *_ in turns for p in prompts]
    all_responses = [r for _, responses, _, _ in turns for r in responses]
    mu = torch.cat([t[2] for t in turns])
    with torch.no_grad():
        logprobs = trainer.token_logprobs(pack(all_prompts, all_responses))
    assert torch.equal(logprobs, mu), (
        f"{(logprobs == mu).float().mean().item():.1%} of {mu.numel()} tokens equal, "
        f"max |diff| {(logprobs - mu).abs().max().item():.3g}"
    )

    # The last turn again with an empty cache (same seeds): a miss gives the hit's tokens and bits.
    llm.reset_prefix_cache()
    again = multi_turn_rollout(llm, last_prompts, [], seed=500 + 1000 * (TURNS - 1))[0]
    miss_prompts, miss_responses, miss_mu, miss_cached = again
    assert miss_cached == [0] * len(last_prompts)
    assert miss_responses == last_responses
    assert torch.equal(miss_mu, last_mu)


def _qwen3_next():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4,
                           layer_types=["linear_attention"] * 3 + ["full_attention"])


def test_unproven_architectures_and_platforms_turn_prefix_caching_off():
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

    from zero_mismatch_plugin.aligned.prefix_caching import ALLOW_ENV, keep_prefix_caching

    llama = LlamaConfig(architectures=["LlamaForCausalLM"], num_hidden_layers=2)
    assert keep_prefix_caching(llama, "cpu", {}) == (True, "proven bitwise for this architecture")
    keep, why = keep_prefix_caching(llama, "cuda", {})
    assert not keep and "not proven bitwise equal to misses on cuda" in why and f"{ALLOW_ENV}=1" in why
    moe = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=2)
    keep, why = keep_prefix_caching(moe, "cpu", {})
    assert not keep and "Qwen3MoeForCausalLM" in why and "dense decoders" in why
    mla = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=2)
    keep, why = keep_prefix_caching(mla, "cpu", {})
    assert not keep and "multi-head latent attention" in why
    hybrid = _qwen3_next()
    keep, why = keep_prefix_caching(hybrid, "cpu", {})
    assert not keep and "linear-attention layers" in why and f"{ALLOW_ENV}=1" in why
    assert not keep_prefix_caching(None, "cpu", {})[0]
    keep, why = keep_prefix_caching(llama, "cpu", {}, lora=True)
    assert not keep and "not proven with LoRA adapters" in why
    # The switch: 1 keeps it on unproven, 0 turns it off everywhere, anything else is refused.
    assert keep_prefix_caching(moe, "cpu", {ALLOW_ENV: "1"})[0]
    assert not keep_prefix_caching(llama, "cpu", {ALLOW_ENV: "0"})[0]
    with pytest.raises(ValueError, match="expected '1' .* or '0'"):
        keep_prefix_caching(llama, "cpu", {ALLOW_ENV: "yes"})


def test_consistent_engine_settings_follow_the_decision(checkpoints, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from zero_mismatch_plugin.integrations.vllm.plugin import PREFIX_CACHING_ENV, consistent_engine_settings

    args = EngineArgs(model=str(checkpoints["llama"]), enable_prefix_caching=True)
    assert not any(c.startswith("enable_prefix_caching") for c in consistent_engine_settings(args))
    assert args.enable_prefix_caching is True
    monkeypatch.setenv(PREFIX_CACHING_ENV, "0")
    args = EngineArgs(model=str(checkpoints["llama"]), enable_prefix_caching=True)
    assert "enable_prefix_caching=False" in consistent_engine_settings(args)
