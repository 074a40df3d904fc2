"""The engine side of ``zmrl check``: its settings, starting vLLM, prompts, and generation helpers.

:func:`engine_settings` turns the checker's arguments into one :class:`EngineSettings` value that
the engine, the trainer backends and vLLM's own modules are all built from.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero_mismatch_plugin.tables.architectures import Blocks

# Logprobs the engine returns per position for the distribution check when the full vocabulary
# is not requested (vLLM's default ``max_logprobs``).
DEFAULT_TOP_K = 20

# Varied English text; a user's own prompts (``--prompts``) are better.
DEFAULT_PROMPTS = (
    "The river runs past the old stone mill and",
    "Question: what is seven plus five? Answer:",
    "Write a short poem about the sea.",
    "In 1905, a young patent clerk published",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Once upon a time, in a small village at the edge of a forest, there lived",
    "To solve the equation 2x + 3 = 11, first",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "A list of things to check before a long drive:",
    "The capital of Australia is",
    "Explain why the sky is blue in one paragraph.",
    "Step 1: preheat the oven to 180 degrees. Step 2:",
    "import numpy as np\nx = np.arange(10)\n",
    "She opened the letter, read the first line, and",
    "Summary of the meeting: the team agreed to",
)


@dataclass
class Completion:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]  # the sampled tokens' logprobs, as the engine recorded them
    # Per position: token id -> logprob of the entries the engine returned (top-k + sampled).
    distributions: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0


# VLLM_CPU_KVCACHE_SPACE the checker's engine runs with where the environment does not set it (GiB).
DEFAULT_CPU_KV_CACHE_GIB = "1"


@dataclass(frozen=True)
class EngineSettings:
    """The checker's engine and what every trainer side mirrors of it (from :func:`engine_settings`)."""

    model_dir: str
    max_model_len: int
    seed: int
    full_vocab: bool
    prefix_caching: bool
    blocks: Blocks  # the checkpoint as ``tables.architectures.describe`` reads it
    # ``VllmRuntime(model_dir, **trainer_args)``: the aligned and Megatron trainers, vLLM's own modules.
    trainer_args: dict
    # ``vllm.LLM(**llm_args)``: the engine arguments the trainer mirrors, plus prefix caching and logprobs.
    llm_args: dict
    # Set while vLLM builds the engine's config and starts its processes (:func:`engine_environment`).
    environment: dict
    lora_dir: str | None = None
    lora_targets: tuple[str, ...] = ()  # the adapter's target modules, checked against the model
    # The engine's tensor_parallel_size; a trainer face of the same tensor parallelism runs on as many
    # ranks (sequence parallelism is the trainer's own choice).
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    # The trainer's expert parallelism (megatron's, with this token dispatcher); the engine keeps
    # every expert in one process (or split over its tensor-parallel ranks), whose arithmetic the
    # face reproduces.
    expert_parallel: int = 1
    moe_token_dispatcher: str = "alltoall"
    # The trainer's pipeline parallelism (megatron's stages); the engine runs every layer in its
    # own process(es), and a stage boundary is a copy.
    pipeline_parallel: int = 1
    # The trainer's context parallelism (megatron's split of each sequence's rows over ranks).
    context_parallel: int = 1


def engine_settings(
    model_dir, max_model_len: int, seed: int = 0, full_vocab: bool = False, lora_dir=None, prefix_caching: bool = True,
    tensor_parallel: int = 1, sequence_parallel: bool = False, expert_parallel: int = 1,
    moe_token_dispatcher: str = "alltoall", pipeline_parallel: int = 1, context_parallel: int = 1,
    dtype: str = "float32",
) -> EngineSettings:
    """The checker's arguments as the engine's configuration, read once: ``vllm.LLM``'s arguments
    (those the aligned trainer mirrors, prefix caching as asked for, enough returned logprobs;
    with ``lora_dir``, LoRA serving sized for that adapter, see :func:`served_adapter`), the
    environment vLLM reads while it starts, and the checkpoint's blocks. ``dtype`` is the engine's
    (``float32`` or ``bfloat16``); the trainer computes in it too."""
    import os

    from zero_mismatch_plugin.aligned.checkpoint import read_config

    from zero_mismatch_plugin.aligned.runtime import cpu_engine_thread_binding, engine_args_for
    from zero_mismatch_plugin.tables.architectures import describe
    from zero_mismatch_plugin.tables.switches import ALLOW_PREFIX_CACHING, CPU_KV_CACHE_SPACE

    model_config = read_config(model_dir)
    trainer_args = dict(max_model_len=max_model_len, seed=seed, dtype=dtype)
    lora_targets = ()
    if lora_dir is not None:
        lora_config, lora_args = served_adapter(model_config, lora_dir)
        trainer_args.update(lora_args)
        lora_targets = tuple(lora_config.targets)
    llm_args = engine_args_for(
        model_dir, enable_prefix_caching=prefix_caching, max_logprobs=-1 if full_vocab else DEFAULT_TOP_K, **trainer_args
    )
    environment = {}
    if tensor_parallel != 1:
        llm_args["tensor_parallel_size"] = tensor_parallel
        environment.update(cpu_engine_thread_binding(tensor_parallel))
    if prefix_caching:
        # Consistent mode turns prefix caching off where it is not proven; the prefix-cache check is
        # how it gets proven, so the engine keeps it on. Every other check resets the cache first.
        environment[ALLOW_PREFIX_CACHING] = "1"
    if CPU_KV_CACHE_SPACE not in os.environ:
        environment[CPU_KV_CACHE_SPACE] = DEFAULT_CPU_KV_CACHE_GIB
    return EngineSettings(
        model_dir=str(model_dir),
        max_model_len=max_model_len,
        seed=seed,
        full_vocab=full_vocab,
        prefix_caching=prefix_caching,
        blocks=describe(model_config),
        trainer_args=trainer_args,
        llm_args=llm_args,
        environment=environment,
        lora_dir=None if lora_dir is None else str(lora_dir),
        lora_targets=lora_targets,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        expert_parallel=expert_parallel,
        moe_token_dispatcher=moe_token_dispatcher,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
    )


def served_adapter(model_config, lora_dir):
    """(the adapter's ``LoRAConfig``, the engine arguments serving it) for the model of
    ``model_config`` (its transformers config): the adapter's targets checked against what the
    aligned path adapts on that model (dense or MLA projections, routed and shared experts,
    embed_tokens / lm_head where the engine adapts them), the engine's ``max_lora_rank`` sized
    for its rank."""
    from zero_mismatch_plugin.aligned.lora.names import supported_lora_targets
    from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args_for_config, read_lora_config

    config = read_lora_config(lora_dir, supported_lora_targets(model_config, vocab=True))
    return config, lora_engine_args_for_config(config)


class AdapterEngine:
    """A ``vllm.LLM`` whose every ``generate`` call carries one ``LoRARequest``: every check then
    runs against the adapter without knowing about it."""

    def __init__(self, llm, lora_dir):
        from zero_mismatch_plugin.aligned.lora.peft import lora_request

        self.llm = llm
        self.lora_request = lora_request("zmrl-check", 1, lora_dir)

    def generate(self, *args, **kwargs):
        kwargs.setdefault("lora_request", self.lora_request)
        return self.llm.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.llm, name)


@contextlib.contextmanager
def engine_environment(settings: EngineSettings):
    """``settings.environment`` in ``os.environ`` for the block, then what was there: for vLLM
    building the engine's config and starting its processes (which inherit it). A
    ``VLLM_CPU_KVCACHE_SPACE`` vLLM's CPU engine would die on is refused, by name."""
    from zero_mismatch_plugin.aligned.numerics import temporary_environment
    from zero_mismatch_plugin.tables.switches import cpu_kv_cache_space

    with temporary_environment(settings.environment):
        cpu_kv_cache_space()
        yield


def vllm_config(settings: EngineSettings):
    """The ``VllmConfig`` an engine of ``settings`` runs with (no engine is started)."""
    with engine_environment(settings):
        from vllm.engine.arg_utils import EngineArgs

        return EngineArgs(**settings.llm_args).create_engine_config()


def prefill_budget(settings: EngineSettings) -> int:
    """Tokens an engine of ``settings`` starts prefills per step, from its config alone (no
    engine is started): what :func:`split_by_budget` allows per prompt."""
    return int(vllm_config(settings).scheduler_config.max_num_batched_tokens)


@contextlib.contextmanager
def open_engine(settings: EngineSettings):
    """Start one vLLM engine of ``settings``; shut it down afterwards."""
    from zero_mismatch_plugin.aligned.runtime import shutdown_engine

    with engine_environment(settings):
        from vllm import LLM

        llm = LLM(**settings.llm_args)
    try:
        yield llm if settings.lora_dir is None else AdapterEngine(llm, settings.lora_dir)
    finally:
        shutdown_engine(llm)


def engine_block_size(llm) -> int:
    return int(llm.llm_engine.vllm_config.cache_config.block_size)


def engine_prefix_caching(llm) -> bool:
    return bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)


def load_prompts(model_dir, prompts_file: str | None, num_prompts: int, vocab_size: int | None = None) -> list[list[int]]:
    """Token ids of ``num_prompts`` prompts (cycled if the source has fewer).

    ``prompts_file``: plain text, one prompt per line, or JSONL with ``prompt`` (text) or
    ``prompt_token_ids`` per line (see :func:`.inputs.read_prompt_file`); token ids must lie in
    ``[0, vocab_size)``.
    """
    from zero_mismatch_plugin.tools.checker.checkpoint_inputs import load_tokenizer
    from zero_mismatch_plugin.tools.checker.inputs import CheckerInputError, read_prompt_file

    sources = read_prompt_file(prompts_file, vocab_size) if prompts_file else list(DEFAULT_PROMPTS)
    tokenizer = None
    if any(isinstance(source, str) for source in sources):
        tokenizer = load_tokenizer(model_dir)
    prompts = []
    for i in range(num_prompts):
        source = sources[i % len(sources)]
        ids = list(source) if isinstance(source, list) else tokenizer(source).input_ids
        if not ids:
            raise CheckerInputError(f"prompt {source!r} has no tokens")
        prompts.append(ids)
    return prompts


def sampling_params(seed: int, max_tokens: int, logprobs: int = 0, **extra):
    """T=1, no truncation: raw and processed logprobs coincide, the trainer needs no mask."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=logprobs,
        seed=seed,
        **extra,
    )


def token_budget(llm) -> int:
    """Tokens the engine's scheduler computes per step (``max_num_batched_tokens``)."""
    return int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)


def split_by_budget(prompts, budget: int) -> list[range]:
    """Consecutive groups of prompts whose prompt tokens fit in one scheduler step.

    A prompt that does not fit in the step is prefilled in chunks, and vLLM 0.31 on CPU fails
    a seeded request whose prefill is chunked ("CPU Generator does not use offset"): seeded
    requests are therefore sent in groups that are prefilled whole.
    """
    groups, start, used = [], 0, 0
    for i, prompt in enumerate(prompts):
        if len(prompt) > budget:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens, more than the engine prefills in one step "
                f"({budget}); shorten it or raise max_num_batched_tokens"
            )
        if used + len(prompt) > budget:
            groups.append(range(start, i))
            start, used = i, 0
        used += len(prompt)
    groups.append(range(start, len(prompts)))
    return groups


def generate(llm, prompts, seeds, max_tokens: int, logprobs: int = 0, reset_cache: bool = True):
    """Sample one completion per prompt, each request with its own seed.

    Prompts go to the engine in as few ``generate`` calls as the scheduler's per-step budget
    allows (see :func:`split_by_budget`); a call is one batch.
    """
    if reset_cache:
        # Prefix caching is on for the prefix-cache check; other checks must see misses only.
        llm.reset_prefix_cache()
    completions = []
    for group in split_by_budget(prompts, token_budget(llm)):
        group_prompts = [prompts[i] for i in group]
        params = [sampling_params(seeds[i], max_tokens, logprobs) for i in group]
        outputs = llm.generate([{"prompt_token_ids": p} for p in group_prompts], params, use_tqdm=False)
        for prompt, out in zip(group_prompts, outputs):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            completions.append(
                Completion(
                    prompt=list(prompt),
                    tokens=tokens,
                    logprobs=[step[t].logprob for t, step in zip(tokens, c.logprobs)],
                    distributions=[{tid: lp.logprob for tid, lp in step.items()} for step in c.logprobs]
                    if logprobs
                    else [],
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                )
            )
    return completions


def rescore(llm, completions) -> list[list[float]]:
    """The engine's prefill logprobs of each completion's tokens (``prompt_logprobs``)."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    # No seed: the one sampled token is discarded, and an unseeded request may be prefilled in
    # chunks (see split_by_budget).
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    inputs = [{"prompt_token_ids": c.prompt + c.tokens} for c in completions]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    scored = []
    for c, out in zip(completions, outputs):
        start = len(c.prompt)
        rows = out.prompt_logprobs[start : start + len(c.tokens)]
        scored.append([row[t].logprob for t, row in zip(c.tokens, rows)])
    return scored
