"""Sliding-window attention, both trainer faces, prefix caching on, for two layouts of windows:

* ``mistral_window``: Mistral, every layer windowed (a model-level ``sliding_window``);
* ``cwm_window``: CWM, local and global layers interleaved as ``layer_types`` says (vLLM runs it as
  its Llama, whose attention takes each layer's window from ``layer_types``; the engine then keeps
  one KV-cache group per kind of layer).

The window (12 tokens) is shorter than most prompts and than every prompt + response, so it is
crossed inside prompts and inside responses. Conversations are re-sent whole over three turns with
the engine's default 128-token KV blocks, so later turns take more than the window from the prefix
cache. The weight-changing test goes last for each model.
"""

from __future__ import annotations

import pytest
import torch

from support import aligned_checks as checks
from support.vllm_session import hf_token_logprobs

WINDOW = 12
SEED = 700
# Each checkpoint's window per layer, as vLLM runs it (None: full causal attention).
LAYER_WINDOWS = {
    "mistral_window": (WINDOW, WINDOW),
    "cwm_window": (WINDOW, None, WINDOW, None),
}


@pytest.fixture(scope="module", params=list(LAYER_WINDOWS))
def name(request):
    return request.param


@pytest.fixture(scope="module", autouse=True)
def engine_accepts_functions(engines):
    """Lets ``collective_rpc`` carry a function to the engine's worker. Engine and client read the
    switch when they (de)serialize, so it stays set while this module's engines live."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield
        engines.pool.close()  # the engines started with the switch set end with the module


@pytest.fixture(scope="module")
def conversations(name, engines, checkpoints):
    return checks.windowed_conversations(engines, checkpoints, name, seed=SEED)


def _engine_layer_windows(worker):
    modules = worker.model_runner.model.named_modules()
    return [m.impl.sliding_window for n, m in modules if n.endswith("self_attn.attn")]


def test_each_layer_gets_its_window_in_trainer_and_engine(name, engines, trainers):
    windows = LAYER_WINDOWS[name]
    trainer = trainers(name)
    assert trainer.blocks.sliding_windows == windows
    assert tuple(a.sliding_window for a in trainer.layer_attention) == windows
    kernel_windows = [a.kernel.layer.impl.sliding_window for a in trainer.layer_attention]
    llm = engines.get(name)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    # The engine's own attention layers, read in its worker: the same window per layer.
    engine_windows = llm.collective_rpc(_engine_layer_windows)[0]
    print(f"{name}: engine layer windows {engine_windows}, trainer kernels {kernel_windows}")
    assert engine_windows == kernel_windows
    assert [w == WINDOW for w in kernel_windows] == [w is not None for w in windows]


def test_windows_crossed_and_prefix_hits_past_the_window(conversations):
    checks.check_windows_crossed_and_hits_past_them(conversations[1], WINDOW)


def test_aligned_model_bitwise_equal_engine(name, conversations, trainers):
    _, _, prompts, responses, mu = conversations
    checks.check_aligned_model_bitwise(trainers(name), prompts, responses, mu)


def test_megatron_face_bitwise_equal_engine(name, conversations, checkpoints):
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

    _, _, prompts, responses, mu = conversations
    windows = LAYER_WINDOWS[name]
    model, runtime = checks.check_megatron_face_bitwise(checkpoints[name], prompts, responses, mu, windows)
    per_layer = [int(w is not None) for w in windows] if None in windows else None
    assert model.config.window_size == (WINDOW - 1, 0) and model.config.window_attn_skip_freq == per_layer
    # A megatron config that lost the checkpoint's layout is refused: without the window, or, for
    # interleaved layers, windowing every layer (no per-layer list) up to the first full layer.
    if per_layer is None:
        dropped, message = dict(window_size=None), "layer 1 has sliding window None in megatron's config but 12"
    else:
        first_full = windows.index(None) + 1
        dropped = dict(window_attn_skip_freq=None)
        message = f"layer {first_full} has sliding window 12 in megatron's config but None"
    with pytest.raises(NotImplementedError, match=message):
        build_gpt_model(runtime, aligned=True, load=False, **dropped)


def test_prefix_hit_equals_miss_across_the_window(conversations):
    llm, turns, *_ = conversations
    checks.check_prefix_hit_equals_miss(llm, turns, seed=SEED, min_cached=WINDOW)


def test_transformers_is_close_but_not_the_engine_bits(name, conversations, trainers):
    """Negative control: transformers' own model (the same windows) is close to μ, not μ; the same
    weights with another layout of windows (transformers' Mistral windows every layer whatever
    ``layer_types`` say, its Llama none) are far, so each layer's own window is exercised."""
    from transformers import LlamaForCausalLM, MistralForCausalLM

    _, _, prompts, responses, mu = conversations
    windows = LAYER_WINDOWS[name]
    with torch.no_grad():
        model = checks.hf_model(trainers(name), torch.float32)
        own = hf_token_logprobs(model, prompts, responses)
        others = {}
        for cls, layout in ((MistralForCausalLM, (WINDOW,) * len(windows)), (LlamaForCausalLM, (None,) * len(windows))):
            if layout == windows:
                continue
            other = cls(cls.config_class(**{**model.config.to_dict(), "sliding_window": WINDOW}))
            other.load_state_dict(model.state_dict())
            other = checks._without_padding_idx(other).eval()
            others[f"{cls.__name__} (windows {layout})"] = hf_token_logprobs(other, prompts, responses)
    print(checks.bitwise_report(f"transformers {type(model).__name__} (windows {windows})", own, mu))
    for label, logprobs in others.items():
        print(checks.bitwise_report(f"transformers {label}", logprobs, mu))
    assert (own - mu).abs().max().item() < 1e-4
    assert not torch.equal(own, mu)
    assert others
    for logprobs in others.values():
        assert (logprobs - mu).abs().max().item() > 1e-3


def test_custom_backward_matches_float64_autograd(name, engines, trainers):
    worst = checks.check_backward_matches_float64(trainers(name), engines, name)
    print(f"{name}: worst relative gradient error vs float64 {worst:.3g}")


def test_equal_again_after_optimizer_step_and_weight_sync(name, engines, trainers):
    checks.check_update_and_sync(engines, trainers, name)
