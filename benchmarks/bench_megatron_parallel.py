"""Aligned vs stock megatron-core at the same parallel layout, on two torchrun ranks over gloo.

Layouts: TP 2 on a dense Llama shape (without sequence parallelism: megatron's stock torch norm
refuses it without Apex or Transformer Engine), and EP 2 (DP 2, megatron's all-to-all dispatcher) on a
Qwen3-MoE shape. Each rank builds the aligned model (its engine rank's part) and megatron's stock
local-spec model of the same checkpoint at the same layout, and runs a batch of equal-length
sequences (megatron's sbhd layout) through both, in alternating order, so that load hits both
alike, repeated until the ratio settles on every rank (up to ``--max-repeats``). Targets: forward
<= 1.05x, forward+backward <= 1.15x.

Prints the host's load, CPUs and torch threads before and after, and per layout, phase and model
(rank 0's samples): minimum and median wall ms, spread ((p75 - p25) / median), median CPU ms of
rank 0's process, and the ratio aligned / stock of the minima and of the medians; rows are flagged
UNRELIABLE when the host was loaded or the ratio did not settle. The ranks run at one thread each
(two ranks share the two cores), so the one-thread variant is the only one here.

    python benchmarks/bench_megatron_parallel.py [--iters 9 --batch 4 --seq 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from timing import Comparison, Samples, compare, format_rows, host_is_loaded, host_line, row_header

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
    p.add_argument("--max-repeats", type=int, default=None,
                   help="cap on the iterations while the ratio has not settled (default 3 x --iters)")
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
        if backward:
            logits = model(input_ids=ids, position_ids=positions, attention_mask=mask)
            logits.float().sum().backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, position_ids=positions, attention_mask=mask)
        torch.distributed.barrier()  # the time of the slower rank

    def start(model):
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()

    def every_rank_settled(settled: bool) -> bool:
        # The ranks stop after the same round, or the barriers of the next one would wait forever.
        flag = torch.tensor([int(settled)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    results = {}
    with cpu_stock_megatron():
        for phase, backward in (("forward", False), ("forward+backward", True)):
            aligned.train(backward)
            stock.train(backward)
            comparison = compare(
                {"aligned": lambda: run(aligned, None, backward), "stock": lambda: run(stock, causal, backward)},
                repeats=args.iters, warmup=args.warmup, max_repeats=args.max_repeats,
                setup={"aligned": lambda: start(aligned), "stock": lambda: start(stock)}, agree=every_rank_settled)
            results[phase] = dict(
                samples={name: [s.walls, s.cpus] for name, s in comparison.samples.items()},
                rounds=comparison.rounds, settled=comparison.settled, loaded_before=comparison.loaded_before,
                loaded_after=comparison.loaded_after, threads=comparison.threads)
    if rank == 0:
        print(f"RESULT {args.rank_of} {json.dumps(results)}", flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.rank_of is not None:
        rank_main(args)
        return
    if args.iters < 7:
        raise SystemExit("--iters: at least 7 timed iterations")
    print(host_line("before"), flush=True)
    workdir = tempfile.mkdtemp(prefix="bench_megatron_parallel_")
    print(f"2 ranks x 1 thread; batch {args.batch} x {args.seq} tokens per rank, hidden {args.hidden}, "
          f"{args.layers} layers; alternating order, {args.iters} timed iterations or more until the ratio "
          f"settles on every rank; ratios: model / stock")
    for name in args.layouts.split(","):
        model_dir = build_checkpoint(args, LAYOUTS[name]["family"], workdir)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--rank-of", name, "--model-dir", model_dir, "--batch", str(args.batch), "--seq", str(args.seq),
                   "--iters", str(args.iters), "--warmup", str(args.warmup)]
        if args.max_repeats is not None:
            command += ["--max-repeats", str(args.max_repeats)]
        loaded_before = host_is_loaded()  # before the ranks start; they check again around each phase
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            raise SystemExit(f"{name}: the ranks failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        for phase, result in json.loads(line.split(" ", 2)[2]).items():
            comparison = Comparison(
                {side: Samples(walls, cpus) for side, (walls, cpus) in result["samples"].items()}, result["rounds"],
                result["settled"], loaded_before or result["loaded_before"],
                result["loaded_after"] or host_is_loaded(), result["threads"])
            target = 1.05 if phase == "forward" else 1.15
            print(f"{name} {phase}: {comparison.line()}; target aligned/stock {target:.2f}")
            print(row_header(24))
            for row in format_rows(comparison, baseline="stock", name_width=24):
                print(row)
    print(host_line("after"))


if __name__ == "__main__":
    main()
