"""Kimi Delta Attention (Kimi Linear) costs on CPU: what the one arithmetic costs the engine, and the
aligned KDA layer against a torch reference of the same layer.

vLLM has no CPU KDA at all (its kernels are Triton), so there is no "fast" engine to compare with;
the engine side compares the plugin's consistent path with the same path whose fresh prefills go
through the chunked form of the rule instead (the algorithm of vLLM's Triton prefill, in torch):
what a CPU engine that prefilled chunk-wise, and so rounded prefill and decode differently, would
save.

* Rollout: a tiny Kimi Linear (KDA layers, dense MLPs) served in ``dtype`` in one process, the two
  prefill paths alternating in the same engine; prefill tokens/s (a prompt-only pass) and
  generated tokens/s (a rollout), medians.
* Layer: one KDA layer of the aligned model (vLLM's linears, the fixed-order conv, the recurrence
  per position, the gated norm; the backward recomputes the chunked rule in float64) against the
  same layer in plain torch (``F.linear``, ``F.conv1d``, the chunked rule, 64 positions a chunk), forward and forward +
  backward, timed alternately, at the default thread count and at one thread, repeated until the
  ratio settles.

Prints the host's load, CPUs and torch threads before and after, and per side the minimum and
median wall ms, spread, median CPU ms and the ratios; rows are flagged UNRELIABLE when the host was
loaded or the ratio did not settle.

    python benchmarks/bench_kda.py [--dtype float32 --prompts 16 --prompt-len 256 --max-tokens 32]
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from pathlib import Path

from timing import (add_timing_arguments, at_threads, compare, format_rows, host_line, print_by_threads, row_header,
                    thread_counts)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine in this process: its prefill path is swapped between the timed passes.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rollout-repeats", type=int, default=5, help="timed passes per prefill path (alternating)")
    p.add_argument("--layer-seqs", type=int, default=4, help="packed sequences in the layer benchmark")
    p.add_argument("--layer-len", type=int, default=256, help="tokens per sequence in the layer benchmark")
    p.add_argument("--layer-repeats", type=int, default=5)
    add_timing_arguments(p)
    return p.parse_args()


def chunked_prefill_recurrence(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, states, seq_lens,
                               kda_recurrence):
    """``kda_recurrence`` (the engine's) with every sequence that starts from a zero state and has
    more than one token computed by the chunked rule instead (decodes and continued prefills unchanged)."""
    import torch

    from zero_mismatch_plugin.aligned.kimi_delta_attention import kda_chunked

    outputs, finals, start = [], [], 0
    for i, n in enumerate(seq_lens):
        rows = slice(start, start + n)
        inputs = (q[rows], k[rows], v[rows], raw_g[rows], raw_beta[rows])
        if n > 1 and not states[i].any():
            out, final = kda_chunked(*(x.float() for x in inputs), A_log.float(), dt_bias.float(), lower_bound, 64)
            out = out.to(v.dtype)
        else:
            out, final = kda_recurrence(*inputs, A_log, dt_bias, lower_bound, states[i:i + 1], [n])
            final = final[0]
        outputs.append(out)
        finals.append(final)
        start += n
    return torch.cat(outputs), torch.stack(finals)


def rollout_benchmark(path, args):
    """One consistent-mode engine; its prefill path alternates between the one arithmetic and the
    chunked prefill: {"prefill" | "rollout": Comparison}, and the tokens one rollout generates."""
    from vllm import LLM, SamplingParams

    from zero_mismatch_plugin.aligned import kimi_delta_attention, numerics
    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine

    numerics.set_mode("consistent")
    llm = LLM(**engine_args_for(path, dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
                                max_num_batched_tokens=args.prompts * args.prompt_len, seed=0))
    import torch

    prompts = torch.randint(8, 512, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0))
    requests = [{"prompt_token_ids": p} for p in prompts.tolist()]
    prefill = SamplingParams(max_tokens=1, ignore_eos=True)
    sample = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    one_arithmetic = kimi_delta_attention.kda_recurrence
    chunked = functools.partial(chunked_prefill_recurrence, kda_recurrence=one_arithmetic)

    def run(recurrence, params):
        kimi_delta_attention.kda_recurrence = recurrence
        try:
            return llm.generate(requests, params, use_tqdm=False)
        finally:
            kimi_delta_attention.kda_recurrence = one_arithmetic

    try:
        outs = run(one_arithmetic, sample)  # warm-up
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        result = {what: compare({"one arithmetic": lambda p=params: run(one_arithmetic, p),
                                 "chunked prefill": lambda p=params: run(chunked, p)},
                                repeats=args.rollout_repeats, warmup=1, max_repeats=args.max_repeats)
                  for what, params in (("prefill", prefill), ("rollout", sample))}
        return result, generated
    finally:
        shutdown_engine(llm)


def layer_benchmark(path, args):
    """The aligned KDA layer and the torch reference side by side, fwd and fwd+bwd, at each thread
    count of :func:`timing.thread_counts`: {threads: {"fwd" | "fwd+bwd": Comparison}}."""
    import torch
    import torch.nn.functional as F

    from zero_mismatch_plugin.aligned import numerics
    from zero_mismatch_plugin.aligned.kimi_delta_attention import kda_chunked
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.faces.hybrid_layers import kimi_delta_attention_mixer

    numerics.set_mode("consistent")
    trainer = AlignedCausalLM.from_pretrained(path, dtype="float32", max_model_len=args.layer_len + 8, seed=0)
    layer = trainer.model.layers[0].self_attn
    kda = trainer.blocks.linear_attention
    size, heads, dim = kda.projection_size, kda.num_heads, kda.head_dim
    in_proj = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.b_proj.weight,
                         layer.f_a_proj.weight]).detach()
    conv = torch.cat([layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight]).detach()
    lens = [args.layer_len] * args.layer_seqs
    hidden = torch.randn(sum(lens), trainer.config.hidden_size)
    grad = torch.randn(sum(lens), trainer.config.hidden_size)
    mixer = functools.partial(kimi_delta_attention_mixer, trainer.layer_ops[0], functools.partial(trainer._linear, 0))

    def reference_mixer(x):
        mixed, raw_beta, f_a = F.linear(x, in_proj).split([3 * size, heads, dim], dim=-1)
        g1 = F.linear(f_a, layer.f_b_proj.weight)
        g2 = F.linear(F.linear(x, layer.g_a_proj.weight), layer.g_b_proj.weight)
        outputs, start = [], 0
        for n in lens:
            rows = slice(start, start + n)
            padded = F.pad(mixed[rows].T[None], (conv.shape[-1] - 1, 0))
            c = F.silu(F.conv1d(padded, conv, groups=conv.shape[0])[0].T)
            q, k, v = (t.reshape(n, heads, dim) for t in c.split(size, dim=-1))
            core, _ = kda_chunked(q, k, v, g1[rows].reshape(n, heads, dim), raw_beta[rows], layer.A_log,
                                  layer.dt_bias, kda.gate_lower_bound, 64)
            normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + kda.norm_eps) * layer.o_norm.weight
            outputs.append((normed * torch.sigmoid(g2[rows].reshape(n, heads, dim))).reshape(n, size))
            start += n
        return F.linear(torch.cat(outputs), layer.o_proj.weight)

    def side(forward, backward):
        x = hidden.clone().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            out = forward(x, lens) if forward is mixer else forward(x)
            if backward:
                out.backward(grad)

    def measure():
        return {("fwd+bwd" if backward else "fwd"): compare(
                    {"aligned": lambda: side(mixer, backward), "torch chunked": lambda: side(reference_mixer, backward)},
                    repeats=args.layer_repeats, warmup=1, max_repeats=args.max_repeats)
                for backward in (False, True)}

    return {threads: at_threads(threads, measure) for threads in thread_counts(args)}


def main():
    args = parse_args()
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_kimi_linear_model

    print(host_line("before"), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_kimi_linear_model(Path(tmp) / "kimi_linear", seed=0))
        # The layer first: the in-process engine's CPU worker binds this process's threads for good.
        layer = layer_benchmark(path, args)
        rollout, generated = rollout_benchmark(path, args)

    print(f"model: tiny Kimi Linear (2 KDA layers, 4 heads x 64, dense MLPs), {args.dtype}, eager, consistent mode")
    print(f"rollout: {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each, one engine, "
          "the two prefill paths alternating; ratios: one arithmetic / chunked prefill in time (above 1: slower)")
    for what, comparison in rollout.items():
        tokens = args.prompts * args.prompt_len if what == "prefill" else generated
        print(f"  {what} ({tokens} tokens per run): {comparison.line()}")
        print("  " + row_header(16))
        for name, row in zip(comparison.samples, format_rows(comparison, baseline="chunked prefill", name_width=16)):
            print(f"  {row}   {tokens / comparison.samples[name].wall.median:9.1f} tokens/s (median)")
    print(f"layer: {args.layer_seqs} sequences x {args.layer_len} tokens, one KDA layer, fp32, alternating order; "
          "ratios: aligned / torch chunked")
    print_by_threads(layer, baseline="torch chunked")
    print(host_line("after"))


if __name__ == "__main__":
    main()
