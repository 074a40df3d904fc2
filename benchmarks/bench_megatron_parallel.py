"""Aligned vs stock megatron-core at the same parallel layout, on two torchrun ranks over gloo.

Layouts: TP 2 on a dense Llama shape (without sequence parallelism: megatron's stock torch norm
refuses it without Apex or Transformer Engine), and EP 2 (DP 2, megatron's all-to-all dispatcher) on a
Qwen3-MoE shape. Each rank builds the aligned model (its engine rank's part) and megatron's stock
local-spec model of the same checkpoint at the same layout, and runs a batch of equal-length
sequences (megatron's sbhd layout) through both, alternating, so that load hits both alike.
Rank 0 reports the median of each and the ratio aligned / stock. Targets: forward <= 1.05x,
forward+backward <= 1.15x.

    python benchmarks/bench_megatron_parallel.py [--iters 9 --batch 4 --seq 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("ZMRL_NUMERICS", "consistent")

LAYOUTS = {
    "tp2": dict(family="llama", layout=dict(tensor_model_parallel_size=2)),
    "ep2-alltoall-dp2": dict(family="qwen3_moe", layout=dict(expert_model_parallel_size=2, data_parallel_size=2,
                                                             moe_token_dispatcher_type="alltoall")),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=9, help="timed iterations of each model (median; at least 7)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # set for the ranks themselves
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_checkpoint(args, family: str, workdir: str) -> str:
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=args.hidden // 8, vocab_size=512, max_position_embeddings=max(512, args.seq))
    if family == "llama":
        shape["intermediate_size"] = 1536
    else:
        shape.update(num_experts=8, top_k=2, moe_intermediate_size=256)
    return str(build_tiny_model(os.path.join(workdir, family), family=family, seed=0, **shape))


def rank_main(args) -> None:
    """One rank: both models at the layout, the batch through each in turn."""
    import torch

    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.distributed import Layout, init_ranks
    from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model, cpu_stock_megatron

    torch.set_num_threads(1)
    layout = Layout(**LAYOUTS[args.rank_of]["layout"])
    init_ranks(layout)
    runtime = VllmRuntime(args.model_dir, max_model_len=max(args.seq, 256), seed=0, **layout.engine_kwargs())
    aligned = build_gpt_model(runtime, aligned=True, **layout.config_overrides())
    with cpu_stock_megatron():
        stock = build_gpt_model(runtime, aligned=False, **layout.config_overrides())
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)  # each data-parallel rank its own sequences
    ids = torch.randint(4, runtime.hf_config.vocab_size, (args.batch, args.seq), generator=g)
    positions = torch.arange(args.seq).expand(args.batch, -1)
    causal = torch.ones(args.seq, args.seq, dtype=torch.bool).triu(1)[None, None]

    def run(model, mask, backward):
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        start = time.perf_counter()
        if backward:
            logits = model(input_ids=ids, position_ids=positions, attention_mask=mask)
            logits.float().sum().backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, position_ids=positions, attention_mask=mask)
        torch.distributed.barrier()
        return time.perf_counter() - start

    results = {}
    with cpu_stock_megatron():
        for phase, backward in (("forward", False), ("forward+backward", True)):
            aligned.train(backward)
            stock.train(backward)
            times = {"aligned": [], "stock": []}
            for i in range(args.warmup + args.iters):
                pair = [("aligned", aligned, None), ("stock", stock, causal)]
                for name, model, mask in (pair if i % 2 == 0 else pair[::-1]):
                    elapsed = run(model, mask, backward)
                    if i >= args.warmup:
                        times[name].append(elapsed)
            results[phase] = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        print(f"RESULT {args.rank_of} " + " ".join(
            f"{phase}:{r['stock'] * 1e3:.1f}:{r['aligned'] * 1e3:.1f}" for phase, r in results.items()), flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.rank_of is not None:
        rank_main(args)
        return
    if args.iters < 7:
        raise SystemExit("--iters: at least 7 timed iterations")
    import torch

    workdir = tempfile.mkdtemp(prefix="bench_megatron_parallel_")
    print(f"2 ranks x 1 thread; batch {args.batch} x {args.seq} tokens per rank, hidden {args.hidden}, "
          f"{args.layers} layers; {args.iters} timed iterations each, alternating (median); host ISA "
          f"{torch.backends.cpu.get_cpu_capability()} (the figures depend on it)")
    print(f"{'layout':<18}{'phase':<18}{'stock ms':>10}{'aligned ms':>12}{'ratio':>8}{'target':>8}")
    for name in args.layouts.split(","):
        model_dir = build_checkpoint(args, LAYOUTS[name]["family"], workdir)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--rank-of", name, "--model-dir", model_dir, "--batch", str(args.batch), "--seq", str(args.seq),
                   "--iters", str(args.iters), "--warmup", str(args.warmup)]
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            raise SystemExit(f"{name}: the ranks failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        for entry in line.split()[2:]:
            phase, stock_ms, aligned_ms = entry.split(":")
            target = 1.05 if phase == "forward" else 1.15
            ratio = float(aligned_ms) / float(stock_ms)
            print(f"{name:<18}{phase:<18}{float(stock_ms):>10.1f}{float(aligned_ms):>12.1f}{ratio:>7.2f}x{target:>7.2f}x")


if __name__ == "__main__":
    main()
