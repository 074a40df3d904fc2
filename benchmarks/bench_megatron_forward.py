"""Aligned vs stock megatron-core GPTModel: forward and forward+backward time, same weights.

Both models are built from one local Llama-shaped checkpoint and run the same batch of
equal-length sequences in megatron's sbhd layout ([s, b]); iterations alternate between the two
models (in alternating order) so that machine load affects both alike, and repeat until the ratio
settles (up to ``--max-repeats``). Targets: forward <= 1.05x, forward+backward <= 1.15x.

Prints the host's load, CPUs and torch threads before and after, and per phase and model: minimum
and median wall ms, spread ((p75 - p25) / median), median CPU ms of this process, and the ratio
aligned / stock of the minima and of the medians; rows are flagged UNRELIABLE when the host was
loaded or the ratio did not settle. The default ``--threads 1`` is itself the one-thread variant;
with ``--threads N`` (N > 1) both phases run at N threads and again at one.

    python benchmarks/bench_megatron_forward.py [--hidden 512 --layers 4 --batch 8 --seq 128]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_aligned_forward import add_shape_arguments, build_model_from_args, print_comparison
from timing import add_timing_arguments, at_threads, compare, host_line, thread_counts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("ZMRL_NUMERICS", "consistent")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser, ("llama",), intermediate=1536, vocab=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    add_timing_arguments(parser)
    args = parser.parse_args()
    print(host_line("before"), flush=True)

    import torch

    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model, cpu_stock_megatron

    torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="bench_megatron_")
    model_dir = build_model_from_args(os.path.join(workdir, "llama"), args, family="llama", seed=0)
    runtime = VllmRuntime(model_dir, max_model_len=max(args.seq, 256), seed=0)
    aligned = build_gpt_model(runtime, aligned=True)
    with cpu_stock_megatron():
        stock = build_gpt_model(runtime, aligned=False)
    vocab = runtime.hf_config.vocab_size
    ids = torch.randint(4, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.seq).expand(args.batch, -1)
    causal = torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1)[None, None]

    def run(model, mask, backward):
        if backward:
            logits = model(input_ids=ids, position_ids=positions, attention_mask=mask)
            logits.float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).sum().backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, position_ids=positions, attention_mask=mask)

    targets = {"forward": 1.05, "forward+backward": 1.15}

    def measure_phases():
        for phase, backward in (("forward", False), ("forward+backward", True)):
            aligned.train(backward)
            stock.train(backward)
            comparison = compare(
                {"aligned": lambda: run(aligned, None, backward), "stock": lambda: run(stock, causal, backward)},
                repeats=args.iters, warmup=args.warmup, max_repeats=args.max_repeats,
                # gradients cleared untimed, as before every iteration
                setup={"aligned": lambda: aligned.zero_grad(set_to_none=True),
                       "stock": lambda: stock.zero_grad(set_to_none=True)})
            print_comparison(f"  {phase}", comparison, "stock", note=f"; target aligned/stock {targets[phase]:.2f}")

    tokens = args.batch * args.seq
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
        f"ffn {args.intermediate}, vocab {vocab}; batch {args.batch} x {args.seq} = {tokens} tokens; "
        f"alternating order, {args.iters} timed iterations or more until the ratio settles; ratios: model / stock"
    )
    with cpu_stock_megatron():
        for threads in thread_counts(args):
            print(f"torch threads {threads}:")
            at_threads(threads, measure_phases)
    print(host_line("after"))


if __name__ == "__main__":
    main()
