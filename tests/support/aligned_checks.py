"""Checks shared by the per-model test files (Llama, Qwen3)."""

from __future__ import annotations

import torch

from support.vllm_session import hf_token_logprobs, multi_turn_rollout, prompts_for, rollout

from zero_mismatch_plugin.aligned import pack

# Relative L2 error allowed between the aligned fp32 gradient and the float64 autograd gradient,
# per parameter tensor. fp32 round-off over a 2-layer model measures ~1e-6 here; an error in an
# analytic backward (a wrong sign, a missing term, a transposed factor) is O(1).
GRAD_REL_TOL = 1e-4


def hf_model(trainer, dtype):
    """A transformers model of the checkpoint carrying the trainer's current weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(trainer.runtime.model_dir), dtype=dtype)
    state = {k: v.detach().to(dtype) for k, v in trainer.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing
    return _without_padding_idx(model).eval()


def _without_padding_idx(model):
    """transformers' embedding drops the gradient of the pad token's row (padding_idx); vLLM's
    has no such row and neither has the trainer, so the reference must not either."""
    model.get_input_embeddings().padding_idx = None
    return model


def check_bitwise_equal(engines, trainers, name):
    llm = engines.get(name)
    trainer = trainers(name)
    prompts, responses, mu = rollout(llm, prompts_for(trainer.runtime.model_dir))
    assert len(responses) >= 8 and all(len(r) >= 16 for r in responses)
    batch = pack(prompts, responses)
    with torch.no_grad():
        logprobs = trainer.token_logprobs(batch)
    assert logprobs.dtype == torch.float32 and mu.dtype == torch.float32
    assert logprobs.shape == mu.shape
    equal = (logprobs == mu).float().mean().item()
    assert torch.equal(logprobs, mu), (
        f"{name}: {equal:.1%} of {mu.numel()} tokens bitwise equal, "
        f"max |diff| {(logprobs - mu).abs().max().item():.3g}"
    )
    return prompts, responses, mu


def check_hf_forward_is_close_and_comparison_discriminates(engines, trainers, name):
    """Negative control: the same weights through transformers' kernels.

    In fp32 they are close to μ; how many tokens come out bit-equal depends on the host's kernels
    (it is returned, for the log, not asserted). In float64 they cannot be equal (μ holds fp32
    values) yet are just as close: the bitwise comparison tells apart forwards that every
    tolerance-based comparison would accept.
    """
    llm = engines.get(name)
    trainer = trainers(name)
    prompts, responses, mu = rollout(llm, prompts_for(trainer.runtime.model_dir), seed=50)
    with torch.no_grad():
        hf32 = hf_token_logprobs(hf_model(trainer, torch.float32), prompts, responses)
        hf64 = hf_token_logprobs(hf_model(trainer, torch.float64), prompts, responses)
    assert hf32.dtype == torch.float32 and hf64.dtype == torch.float64
    # Same model: both agree with the engine to fp32 round-off ...
    assert (hf32 - mu).abs().max().item() < 1e-4, (hf32 - mu).abs().max().item()
    assert (hf64 - mu.double()).abs().max().item() < 1e-4, (hf64 - mu.double()).abs().max().item()
    # ... and the float64 forward is not the engine's bits.
    assert not torch.equal(hf64, mu.double())
    return (hf32 == mu).float().mean().item(), (hf32 - mu).abs().max().item()


def check_backward_matches_float64(trainer, engines, name):
    """Aligned custom backward vs float64 autograd through transformers, per parameter."""
    llm = engines.get(name)
    prompts, responses, _ = rollout(llm, prompts_for(trainer.runtime.model_dir), seed=90, n=1)
    batch = pack(prompts, responses)
    coeffs = torch.randn(batch.target_ids.numel(), generator=torch.Generator().manual_seed(0))

    trainer.zero_grad(set_to_none=True)
    (trainer.token_logprobs(batch) * coeffs).sum().backward()
    aligned = {n: p.grad.detach().clone() for n, p in trainer.named_parameters()}
    trainer.zero_grad(set_to_none=True)

    ref_model = hf_model(trainer, torch.float64)
    lp = hf_token_logprobs(ref_model, prompts, responses)
    (lp * coeffs.double()).sum().backward()
    reference = dict(ref_model.named_parameters())

    worst = 0.0
    for n, g in aligned.items():
        ref = reference[n].grad
        assert ref is not None, n
        rel = ((g.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        worst = max(worst, rel)
        assert rel < GRAD_REL_TOL, f"{n}: relative gradient error {rel:.3g}"
    return worst


def check_sampling_transform(engines, trainers, name):
    """T != 1 with top-k/top-p: processed μ is reproduced by replaying vLLM's mask."""
    from zero_mismatch_plugin.aligned import SamplingTransform

    llm = engines.get(name)
    trainer = trainers(name)
    sampling = dict(temperature=0.7, top_k=20, top_p=0.9)
    prompts, responses, mu = rollout(llm, prompts_for(trainer.runtime.model_dir), seed=300, **sampling)
    batch = pack(prompts, responses)
    with torch.no_grad():
        replayed = trainer.token_logprobs(batch, SamplingTransform(**sampling))
        untruncated = trainer.token_logprobs(
            batch, SamplingTransform(**sampling, replay_mask=False), strict=False
        )
        unscaled = trainer.token_logprobs(batch, SamplingTransform())
    assert torch.equal(replayed, mu), f"{(replayed == mu).float().mean().item():.1%} equal"
    # Both halves of the transform matter: without the mask or without 1/T it is not μ.
    assert not torch.equal(untruncated, mu)
    assert not torch.equal(unscaled, mu)


def check_update_and_sync(engines, trainers, name):
    """One optimizer step, sync into the engine, and the next rollout is again bitwise equal."""
    from zero_mismatch_plugin.aligned.weight_sync import sync_weights

    llm = engines.get(name)
    trainer = trainers(name)
    prompts = prompts_for(trainer.runtime.model_dir)
    before_prompts, before_responses, before_mu = rollout(llm, prompts, seed=200)

    optimizer = torch.optim.AdamW(trainer.parameters(), lr=5e-3)
    batch = pack(before_prompts, before_responses)
    (-trainer.token_logprobs(batch).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    sync_weights(llm, trainer)
    _, after_responses, after_mu = rollout(llm, prompts, seed=200)
    # Same seeds: only the weights can have changed the rollout.
    assert after_responses != before_responses or not torch.equal(after_mu, before_mu)
    after = pack(before_prompts, after_responses)
    trainer.refresh_derived_weights()  # explicit re-derivation must give the same result
    with torch.no_grad():
        logprobs = trainer.token_logprobs(after)
    assert torch.equal(logprobs, after_mu), (
        f"after sync: {(logprobs == after_mu).float().mean().item():.1%} equal"
    )
    engines.updated[name] = llm  # both hold updated weights until the module ends (tests/conftest.py)


def windowed_conversations(engines, checkpoints, name, seed):
    """Three turns of 8 conversations re-sent whole with the prefix cache on; the first prompts are
    110..145 tokens, so every later prompt is longer than one 128-token block and a hit reaches
    past a short window. Returns (engine, turns, all prompts, all responses, μ of all turns)."""
    llm = engines.get(name)
    pieces = prompts_for(checkpoints[name], num_prompts=8, corpus_seed=41)
    text = sum(pieces * 4, [])
    first = [text[7 * i : 7 * i + 110 + 5 * i] for i in range(8)]
    follow_ups = [prompts_for(checkpoints[name], num_prompts=8, corpus_seed=50 + t) for t in range(2)]
    llm.reset_prefix_cache()
    turns = multi_turn_rollout(llm, first, follow_ups, seed=seed)
    prompts = [p for t in turns for p in t[0]]
    responses = [r for t in turns for r in t[1]]
    return llm, turns, prompts, responses, torch.cat([t[2] for t in turns])


def bitwise_report(name, logprobs, mu):
    equal = (logprobs == mu).float().mean().item()
    return f"{name}: {equal:.1%} of {mu.numel()} tokens bitwise equal, max |diff| {(logprobs - mu).abs().max().item():.3g}"


def check_windows_crossed_and_hits_past_them(turns, window):
    """The window is crossed inside every first prompt and inside every response, and most later
    turns take whole 128-token blocks (far past the window) from the prefix cache."""
    assert all(len(p) > window for p in turns[0][0])
    assert all(len(r) > window for t in turns for r in t[1])
    for _, _, _, cached in turns[1:]:
        # (A block filled only by the previous turn's response was not hit on the next turn here.)
        assert sum(c >= 128 for c in cached) >= len(cached) // 2, cached
    print(f"cached prompt tokens per turn: {[sum(t[3]) for t in turns]} of {[sum(map(len, t[0])) for t in turns]}")


def check_aligned_model_bitwise(trainer, prompts, responses, mu):
    with torch.no_grad():
        logprobs = trainer.token_logprobs(pack(prompts, responses))
    assert torch.equal(logprobs, mu), bitwise_report("aligned model", logprobs, mu)


def check_megatron_face_bitwise(checkpoint, prompts, responses, mu, layer_windows):
    """The aligned Megatron face of ``checkpoint``: each core attention carries its layer's window
    (``layer_windows``) and the logprobs are μ's bits. Returns (model, runtime)."""
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.faces.megatron.modules import AlignedCoreAttention
    from zero_mismatch_plugin.integrations.megatron.standalone import (
        build_gpt_model,
        init_single_process,
        packed_logits,
        token_logprobs_from_logits,
    )

    init_single_process()
    runtime = VllmRuntime(checkpoint, max_model_len=256, seed=0)
    model = build_gpt_model(runtime, aligned=True).eval()
    cores = [m for m in model.modules() if isinstance(m, AlignedCoreAttention)]
    assert tuple(c.sliding_window for c in cores) == tuple(layer_windows)
    batch = pack(prompts, responses)
    with torch.no_grad():
        logprobs = token_logprobs_from_logits(packed_logits(model, batch), batch)
    assert torch.equal(logprobs, mu), bitwise_report("megatron face", logprobs, mu)
    return model, runtime


def check_prefix_hit_equals_miss(llm, turns, seed, min_cached):
    """The last turn again with an empty cache, same seeds (``seed``: the conversations'): tokens
    and logprobs identical."""
    prompts, responses, mu, cached = turns[-1]
    llm.reset_prefix_cache()
    last_seed = seed + 1000 * (len(turns) - 1)  # multi_turn_rollout's seed of the last turn
    _, miss_responses, miss_mu, miss_cached = multi_turn_rollout(llm, prompts, [], seed=last_seed)[0]
    assert min(cached) > min_cached and miss_cached == [0] * len(prompts)
    assert miss_responses == responses
    assert torch.equal(miss_mu, mu)


def check_lora_backward_matches_float64(trainer, rows, reference):
    """The adapter's aligned gradient vs float64 autograd, per A and B; the frozen base gets none.

    ``rows``: engine rollouts (prompt, response, μ, ...) with the trainer's adapter; ``reference(trainer)``:
    a float64 model carrying the same base and adapter, and ``{trainer adapter parameter name:
    its reference parameter}``. Returns the worst relative error."""
    batch = pack([r[0] for r in rows], [r[1] for r in rows])
    coeffs = torch.randn(batch.target_ids.numel(), generator=torch.Generator().manual_seed(0))

    trainer.zero_grad(set_to_none=True)
    (trainer.token_logprobs(batch) * coeffs).sum().backward()
    base = {n: p for n, p in trainer.named_parameters() if not n.startswith("lora.")}
    assert base and all(p.grad is None and not p.requires_grad for p in base.values())
    aligned = {n: p.grad.detach().clone() for n, p in trainer.lora.named_parameters()}
    trainer.zero_grad(set_to_none=True)

    model, params = reference(trainer)
    lp = hf_token_logprobs(model, [r[0] for r in rows], [r[1] for r in rows])
    # The reference reads the same adapter: its forward agrees with the engine to round-off.
    assert (lp - torch.cat([r[2] for r in rows]).double()).abs().max().item() < 1e-4
    (lp * coeffs.double()).sum().backward()
    assert set(params) == set(aligned)
    worst = 0.0
    for name, g in aligned.items():
        ref = params[name].grad
        rel = ((g.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        worst = max(worst, rel)
        assert rel < GRAD_REL_TOL, f"{name}: relative gradient error {rel:.3g}"
    return worst


def lora_generate(llm, prompts, requests, seed=0, max_tokens=12):
    """One batch; per sequence (prompt, response, μ, request). The seed is the prompt's own, so a
    sequence is sampled alike alone or in any batch."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                             seed=seed + hash(tuple(p)) % 10_000) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False)
    rows = []
    for prompt, out, request in zip(prompts, outs, requests):
        ids = list(out.outputs[0].token_ids)
        mu = torch.tensor([step[t].logprob for t, step in zip(ids, out.outputs[0].logprobs)])
        rows.append((prompt, ids, mu, request))
    return rows


def lora_score(trainer, rows, adapter=True):
    """The trainer's logprobs of (prompt, response, ...) rows, with its adapter or without."""
    batch = pack([r[0] for r in rows], [r[1] for r in rows])
    with torch.no_grad():
        if adapter:
            return trainer.token_logprobs(batch)
        with trainer.adapter_disabled():
            return trainer.token_logprobs(batch)


def assert_lora_bitwise(trainer_lp, rows, what):
    """The trainer's logprobs equal the engine's μ (``row[2]``) of ``rows`` bit for bit."""
    mu = torch.cat([r[2] for r in rows])
    assert trainer_lp.shape == mu.shape
    assert torch.equal(trainer_lp, mu), (
        f"{what}: {(trainer_lp == mu).float().mean().item():.1%} of {mu.numel()} tokens bitwise equal, "
        f"max |diff| {(trainer_lp - mu).abs().max().item():.3g}"
    )


def lora_engines(engines, engine_kwargs, module: str):
    """Engines with LoRA (``engine_kwargs``) for the tests of ``module``, from the same pool as ``engines``."""
    from support.vllm_session import Engines

    return Engines(engines.pool, engines.checkpoints, scope=module, **engine_kwargs)
