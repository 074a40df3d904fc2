"""Aligned vs stock megatron-core GPTModel: forward and forward+backward time, same weights.

Both models are built from one local Llama-shaped checkpoint and run the same batch of
equal-length sequences in megatron's sbhd layout ([s, b]); iterations alternate between the two
models so that machine load affects both alike. Reports the median of each and the ratio
aligned / stock. Targets: forward <= 1.05x, forward+backward <= 1.15x.

    python benchmarks/bench_megatron_forward.py [--hidden 512 --layers 4 --batch 8 --seq 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench_aligned_forward import add_shape_arguments, build_model_from_args

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
    args = parser.parse_args()

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
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if backward:
            logits = model(input_ids=ids, position_ids=positions, attention_mask=mask)
            logits.float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).sum().backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, position_ids=positions, attention_mask=mask)
        return time.perf_counter() - start

    results = {}
    with cpu_stock_megatron():
        for phase, backward in (("forward", False), ("forward+backward", True)):
            aligned.train(backward)
            stock.train(backward)
            times = {"aligned": [], "stock": []}
            for i in range(args.warmup + args.iters):
                t_aligned = run(aligned, None, backward)
                t_stock = run(stock, causal, backward)
                if i >= args.warmup:
                    times["aligned"].append(t_aligned)
                    times["stock"].append(t_stock)
            results[phase] = {k: statistics.median(v) for k, v in times.items()}

    tokens = args.batch * args.seq
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
        f"ffn {args.intermediate}, vocab {vocab}; batch {args.batch} x {args.seq} = {tokens} tokens; "
        f"{args.threads} thread(s), {args.iters} timed iterations (median); "
        f"host ISA {torch.backends.cpu.get_cpu_capability()} (the figures depend on it)"
    )
    print(f"{'phase':<18}{'stock ms':>10}{'aligned ms':>12}{'ratio':>8}{'target':>8}")
    for phase, target in (("forward", 1.05), ("forward+backward", 1.15)):
        r = results[phase]
        ratio = r["aligned"] / r["stock"]
        print(
            f"{phase:<18}{r['stock'] * 1e3:>10.1f}{r['aligned'] * 1e3:>12.1f}{ratio:>7.2f}x"
            f"{target:>7.2f}x"
        )


if __name__ == "__main__":
    main()
