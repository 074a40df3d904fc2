"""The engine side of ``zmrl check``: starting vLLM, prompts, and generation helpers."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

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


def engine_kwargs(
    model_dir, max_model_len: int, seed: int, full_vocab: bool, lora_dir=None, prefix_caching: bool = True
) -> dict:
    """``vllm.LLM`` arguments for the checker's engine (those the aligned trainer mirrors, plus
    prefix caching as asked for and enough returned logprobs; with ``lora_dir``, LoRA serving
    sized for that adapter)."""
    from zero_mismatch_plugin.aligned.runtime import engine_args_for

    extra = served_adapter(model_dir, lora_dir)[1] if lora_dir is not None else {}
    return engine_args_for(
        model_dir,
        max_model_len=max_model_len,
        seed=seed,
        enable_prefix_caching=prefix_caching,
        max_logprobs=-1 if full_vocab else DEFAULT_TOP_K,
        **extra,
    )


def served_adapter(model_dir, lora_dir):
    """(the adapter's ``LoRAConfig``, the engine arguments serving it) for the checkpoint in
    ``model_dir``: its targets checked against what the aligned path adapts on that model (dense
    or MLA projections, routed and shared experts, embed_tokens / lm_head where the engine adapts
    them), the engine's ``max_lora_rank`` sized for its rank."""
    from transformers import AutoConfig

    from zero_mismatch_plugin.aligned.lora import lora_engine_args_for_config, read_lora_config, supported_lora_targets

    model_config = AutoConfig.from_pretrained(str(model_dir))
    config = read_lora_config(lora_dir, supported_lora_targets(model_config, vocab=True))
    return config, lora_engine_args_for_config(config)


class AdapterEngine:
    """A ``vllm.LLM`` whose every ``generate`` call carries one ``LoRARequest``: every check then
    runs against the adapter without knowing about it."""

    def __init__(self, llm, lora_dir):
        from zero_mismatch_plugin.aligned.lora_formats import lora_request

        self.llm = llm
        self.lora_request = lora_request("zmrl-check", 1, lora_dir)

    def generate(self, *args, **kwargs):
        kwargs.setdefault("lora_request", self.lora_request)
        return self.llm.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.llm, name)


def _prefix_caching_environment(prefix_caching: bool) -> dict[str, str]:
    # Consistent mode turns prefix caching off where it is not proven; the prefix-cache check is
    # how it gets proven, so with it on the engine keeps it on regardless. Every other check
    # resets the cache before generating.
    from zero_mismatch_plugin.integrations.vllm.plugin import PREFIX_CACHING_ENV

    return {PREFIX_CACHING_ENV: "1"} if prefix_caching else {}


@contextlib.contextmanager
def open_engine(
    model_dir, max_model_len: int, seed: int = 0, full_vocab: bool = False, lora_dir=None, prefix_caching: bool = True
):
    """Start one vLLM engine for the checks; shut it down afterwards."""
    from zero_mismatch_plugin.tables.switches import default_cpu_kv_cache_space

    default_cpu_kv_cache_space()  # 1 GiB unless set; a value vLLM's CPU engine would die on is refused
    from vllm import LLM

    from zero_mismatch_plugin.aligned.numerics import temporary_environment
    from zero_mismatch_plugin.aligned.runtime import shutdown_engine

    with temporary_environment(_prefix_caching_environment(prefix_caching)):
        llm = LLM(**engine_kwargs(model_dir, max_model_len, seed, full_vocab, lora_dir, prefix_caching))
    try:
        yield llm if lora_dir is None else AdapterEngine(llm, lora_dir)
    finally:
        shutdown_engine(llm)


def engine_config(
    model_dir, max_model_len: int, seed: int = 0, full_vocab: bool = False, lora_dir=None, prefix_caching: bool = True
):
    """The ``VllmConfig`` the engine of :func:`open_engine` would run with (no engine is started)."""
    from zero_mismatch_plugin.tables.switches import cpu_kv_cache_space

    cpu_kv_cache_space()  # vLLM's CPU platform reads it here already: refuse a bad value by name
    from vllm.engine.arg_utils import EngineArgs

    from zero_mismatch_plugin.aligned.numerics import temporary_environment

    with temporary_environment(_prefix_caching_environment(prefix_caching)):
        kwargs = engine_kwargs(model_dir, max_model_len, seed, full_vocab, lora_dir, prefix_caching)
        return EngineArgs(**kwargs).create_engine_config()


def prefill_budget(
    model_dir, max_model_len: int, seed: int = 0, full_vocab: bool = False, lora_dir=None, prefix_caching: bool = True
) -> int:
    """Tokens the engine :func:`open_engine` would start prefills per step, from its config alone
    (no engine is started): what :func:`split_by_budget` allows per prompt."""
    config = engine_config(model_dir, max_model_len, seed, full_vocab, lora_dir, prefix_caching)
    return int(config.scheduler_config.max_num_batched_tokens)


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
