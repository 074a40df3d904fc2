"""Aligned Mixture-of-Experts forward (and forward+backward) vs transformers' MoE forward, same model/batch.

Both compute the per-token logprobs of the response tokens of the same batch: the aligned model
over the packed sequences through vLLM's kernels (its router and fused-experts layer included),
transformers over the same sequences as a [batch, length] tensor with its default experts
implementation. Default shape: 8 experts, top-2, hidden 512, 4 layers, 8 x 256 tokens. The two
are timed in alternating order, repeated until the ratio settles (up to ``--max-repeats``).

Prints the host's load, CPUs and torch threads before and after; then, at the default torch
thread count (or ``--threads``) and again at one thread (both phases have the one-thread variant),
per phase and model: minimum and median wall ms, spread, median CPU ms of this process, and the
ratio aligned / transformers of the minima and of the medians (as bench_aligned_forward.py); rows
are flagged UNRELIABLE when the host was loaded or the ratio did not settle.

    python benchmarks/bench_moe_forward.py [--experts 8 --top-k 2 --layers 4 --hidden 512 ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_aligned_forward import (add_dtype_argument, add_run_arguments, add_shape_arguments, build_model_from_args,
                                   compare_with_transformers, load_aligned_and_transformers)
from timing import host_line

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ZMRL_NUMERICS", "consistent")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p, ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"), intermediate=512,
                        intermediate_help="expert width (moe_intermediate_size)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    add_run_arguments(p)
    add_dtype_argument(p)
    return p.parse_args()


def main():
    args = parse_args()
    import torch

    print(host_line("before"), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_from_args(
            tmp, args, args.prompt_len + args.response_len, moe_intermediate_size=args.intermediate,
            shared_expert_intermediate_size=args.intermediate, num_experts=args.experts, top_k=args.top_k,
        )
        # The checkpoint both load: the same weights (transformers fuses the experts itself).
        aligned, hf = load_aligned_and_transformers(path, args.prompt_len + args.response_len, args.dtype)
    compare_with_transformers(
        args, aligned, hf,
        f"{args.family} experts={args.experts} top-{args.top_k} layers={args.layers} hidden={args.hidden} "
        f"expert width={args.intermediate} heads={args.heads}/{args.kv_heads} vocab={args.vocab}, {args.dtype}",
    )
    print(host_line("after"))


if __name__ == "__main__":
    main()
