"""Fixtures for the aligned megatron-core tests: one tiny checkpoint, one live vLLM engine.

Everything here is package-scoped: ZMRL_NUMERICS=consistent is set while these tests run and
the engine (one start, ~30 s on CPU) is shut down when they are done.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

# vLLM reads these when its processes start; set before anything imports vLLM.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_MODEL_LEN = 256
ENGINE_KWARGS = dict(max_model_len=MAX_MODEL_LEN, seed=0)
NUM_PROMPTS = 8
SAMPLES_PER_PROMPT = 2
RESPONSE_TOKENS = 24


@pytest.fixture(scope="package", autouse=True)
def mg_consistent_mode():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZMRL_NUMERICS", "consistent")
        yield


@pytest.fixture(scope="package")
def mg_checkpoints(tmp_path_factory, mg_consistent_mode):
    from zero_mismatch_plugin.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("megatron_tiny_models")
    return {
        "llama": build_tiny_model(root / "llama", family="llama", seed=1),
        "qwen3": build_tiny_model(root / "qwen3", family="qwen3", seed=2),
    }


@pytest.fixture(scope="package")
def mg_runtime(mg_checkpoints):
    """The engine's config and vLLM layers for the Llama checkpoint (trainer side)."""
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.megatron.standalone import init_single_process

    init_single_process()
    return VllmRuntime(mg_checkpoints["llama"], **ENGINE_KWARGS)


@pytest.fixture(scope="package")
def mg_engine(mg_checkpoints):
    from vllm import LLM

    from zero_mismatch_plugin.aligned.runtime import engine_args_for

    llm = LLM(**engine_args_for(mg_checkpoints["llama"], **ENGINE_KWARGS))
    yield llm
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def prompts_for(checkpoint, num_prompts=NUM_PROMPTS):
    """Prompts of different lengths (4..15 tokens) from the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    from zero_mismatch_plugin.tiny_models import tiny_corpus

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = []
    for i, line in enumerate(tiny_corpus(num_prompts * 4, seed=11)):
        ids = tok(line).input_ids
        want = 4 + (i * 5) % 12
        if len(ids) >= want:
            prompts.append(ids[:want])
        if len(prompts) == num_prompts:
            return prompts
    raise AssertionError("corpus too short for the requested prompts")


def rollout(llm, prompts, seed=0, n=SAMPLES_PER_PROMPT, max_tokens=RESPONSE_TOKENS):
    """n sampled responses per prompt in one batch (T=1); returns (prompts, responses, μ)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                       logprobs=0, seed=seed + i)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seq_prompts, responses, mu = [], [], []
    for prompt, out in zip(prompts, outs):
        for completion in out.outputs:
            ids = list(completion.token_ids)
            seq_prompts.append(prompt)
            responses.append(ids)
            mu.extend(step[t].logprob for t, step in zip(ids, completion.logprobs))
    return seq_prompts, responses, torch.tensor(mu, dtype=torch.float32)


@pytest.fixture(scope="package")
def mg_rollout(mg_engine, mg_checkpoints):
    """rollout(seed, n=...) on the Llama engine with the standard prompts."""
    prompts = prompts_for(mg_checkpoints["llama"])

    def run(seed=0, **kwargs):
        return rollout(mg_engine, prompts, seed=seed, **kwargs)

    return run
