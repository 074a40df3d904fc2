"""Interleaved local/global attention layers (CWM: sliding-window and full layers alternating, as
``layer_types`` says), both trainer faces, prefix caching on.

vLLM runs CwmForCausalLM as its Llama, whose attention takes each layer's window from
``layer_types``; the engine then keeps one KV-cache group per kind of layer. The window (12 tokens)
is shorter than most prompts and than every prompt + response, so it is crossed inside prompts and
inside responses; later turns take whole 128-token blocks from the prefix cache. The
weight-changing test goes last.
"""

from __future__ import annotations

import pytest
import torch

import aligned_checks as checks
from vllm_session import hf_token_logprobs

from zero_mismatch_plugin.aligned import pack

NAME = "cwm_window"
WINDOW = 12
LAYER_WINDOWS = (WINDOW, None, WINDOW, None)
SEED = 900


@pytest.fixture(scope="module", autouse=True)
def engine_accepts_functions(engines):
    """Lets ``collective_rpc`` carry a function to the engine's worker. Engine and client read the
    switch when they (de)serialize, so it stays set while this module's engine lives."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield
        engines.close()


@pytest.fixture(scope="module")
def conversations(engines, checkpoints):
    return checks.windowed_conversations(engines, checkpoints, NAME, seed=SEED)


def test_each_layer_gets_its_own_window_in_trainer_and_engine(engines, trainers):
    trainer = trainers(NAME)
    assert trainer.blocks.sliding_windows == LAYER_WINDOWS
    assert tuple(a.sliding_window for a in trainer.layer_attention) == LAYER_WINDOWS
    kernel_windows = [a.kernel.layer.impl.sliding_window for a in trainer.layer_attention]
    llm = engines.get(NAME)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    # The engine's own attention layers, read in its worker: the same window per layer.
    engine_windows = llm.collective_rpc(_engine_layer_windows)[0]
    print(f"engine layer windows {engine_windows}, trainer kernels {kernel_windows}")
    assert engine_windows == kernel_windows
    assert kernel_windows[0] == kernel_windows[2] == WINDOW and kernel_windows[1] == kernel_windows[3] != WINDOW


def _engine_layer_windows(worker):
    modules = worker.model_runner.model.named_modules()
    return [m.impl.sliding_window for n, m in modules if n.endswith("self_attn.attn")]


def test_windows_crossed_and_prefix_hits_past_the_window(conversations):
    _, turns, prompts, responses, _ = conversations
    assert all(len(p) > WINDOW for p in turns[0][0])  # crossed inside prompts
    assert all(len(r) > WINDOW for r in responses)  # and inside responses
    for _, _, _, cached in turns[1:]:
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
    assert model.config.window_size == (WINDOW - 1, 0) and model.config.window_attn_skip_freq == [1, 0, 1, 0]
    cores = [m for m in model.modules() if isinstance(m, AlignedCoreAttention)]
    assert tuple(c.sliding_window for c in cores) == LAYER_WINDOWS
    assert torch.equal(logprobs, mu), checks.bitwise_report("megatron face", logprobs, mu)
    # A megatron config that windows every layer (no per-layer list) is refused at the first full layer.
    with pytest.raises(NotImplementedError, match="layer 2 has sliding window 12 in megatron's config but None"):
        build_gpt_model(runtime, aligned=True, load=False, window_attn_skip_freq=None)


def test_prefix_hit_equals_miss_across_the_window(conversations):
    llm, turns, *_ = conversations
    checks.check_prefix_hit_equals_miss(llm, turns, seed=SEED, min_cached=WINDOW)


def test_trainers_that_ignore_the_layer_types_are_not_the_engine_bits(conversations, trainers):
    """Negative control: transformers' CWM (the same per-layer windows) is close to μ, not μ; the
    same weights with the layer types ignored (transformers' Mistral windows every layer, its Llama
    none) are far from μ, so each layer's own window is exercised."""
    from transformers import LlamaForCausalLM, MistralForCausalLM

    _, _, prompts, responses, mu = conversations
    trainer = trainers(NAME)
    with torch.no_grad():
        model = checks.hf_model(trainer, torch.float32)
        typed = hf_token_logprobs(model, prompts, responses)
        ignoring = {}
        for cls in (MistralForCausalLM, LlamaForCausalLM):
            other = cls(cls.config_class(**{**model.config.to_dict(), "sliding_window": WINDOW}))
            other.load_state_dict(model.state_dict())
            ignoring[cls.__name__] = hf_token_logprobs(checks._without_padding_idx(other).eval(), prompts, responses)
    print(checks.bitwise_report("transformers CwmForCausalLM (per-layer windows)", typed, mu))
    for name, logprobs in ignoring.items():
        print(checks.bitwise_report(f"transformers {name} (layer types ignored)", logprobs, mu))
    assert (typed - mu).abs().max().item() < 1e-4
    assert not torch.equal(typed, mu)
    for logprobs in ignoring.values():
        assert (logprobs - mu).abs().max().item() > 1e-3
        assert not torch.equal(logprobs, mu)


def test_custom_backward_matches_float64_autograd(engines, trainers):
    worst = checks.check_backward_matches_float64(trainers(NAME), engines, NAME)
    print(f"{NAME}: worst relative gradient error vs float64 {worst:.3g}")


def test_equal_again_after_optimizer_step_and_weight_sync(engines, trainers):
    checks.check_update_and_sync(engines, trainers, NAME)
