"""Aligned trainer forward (and forward+backward) vs a plain transformers forward, same model/batch.

Both compute the per-token logprobs of the response tokens of the same batch: the aligned model
over the packed sequences through vLLM's kernels, transformers over the same sequences as a
[batch, length] tensor (all sequences have the same length, so no padding). The two are timed in
alternating order, repeated until the ratio settles (up to ``--max-repeats``).

Prints the host's load, CPUs and torch threads before and after; then, at the default torch
thread count (or ``--threads``) and again at one thread (both phases have the one-thread variant),
per phase and model: minimum and median wall ms, spread ((p75 - p25) / median), median CPU ms of
this process, and the ratio aligned / transformers of the minima and of the medians, beside the
target; rows are flagged UNRELIABLE when the host was loaded or the ratio did not settle.

    python benchmarks/bench_aligned_forward.py [--layers 4 --hidden 512 ...] [--dtype bfloat16]

With ``--dtype bfloat16`` both run in bf16: the aligned model's fp32 master weights with the
engine's bf16 copies (verl's FSDP mixed precision), transformers with bf16 weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from timing import (add_timing_arguments, at_threads, compare, format_rows, host_line, row_header,
                    thread_counts)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ZMRL_NUMERICS", "consistent")


def add_shape_arguments(p, families, intermediate: int = 1408, intermediate_help: str | None = None,
                        vocab: int = 2048):
    """The tiny model's shape options every benchmark takes (see :func:`build_model_from_args`)."""
    p.add_argument("--family", default=families[0], choices=list(families))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=intermediate, help=intermediate_help)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=vocab)


def add_run_arguments(p, *, batch=8, prompt_len=16, response_len=240, repeats=7, warmup=2, threads=0):
    """The batch and timing options the rollout-shaped benchmarks take; None leaves one out."""
    for flag, default in (("--batch", batch), ("--prompt-len", prompt_len), ("--response-len", response_len),
                          ("--repeats", repeats), ("--warmup", warmup)):
        if default is not None:
            p.add_argument(flag, type=int, default=default)
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help="torch threads (0: torch default)")
    add_timing_arguments(p)


def add_dtype_argument(p):
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the engine's dtype, which the models compute in (default float32)")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p, ("llama", "qwen2", "qwen3"))
    add_run_arguments(p)
    add_dtype_argument(p)
    return p.parse_args()


def compare_sides(args, contenders):
    """The contenders timed side by side with the benchmark's ``--repeats --warmup --max-repeats``."""
    return compare(contenders, repeats=args.repeats, warmup=args.warmup, max_repeats=args.max_repeats)


def print_comparison(title: str, comparison, baseline: str, name_width: int = 24, note: str = "") -> None:
    """A comparison's rows under a title that says how its samples were taken."""
    print(f"{title}: {comparison.line()}{note}")
    print(row_header(name_width))
    for row in format_rows(comparison, baseline=baseline, name_width=name_width):
        print(row)


def build_model_from_args(out_dir, args, max_len: int = 0, **extra):
    """The tiny checkpoint a benchmark's shape arguments (``--family --layers --hidden
    --intermediate --heads --kv-heads --vocab``) describe; ``extra`` overrides or adds fields."""
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    shape = dict(
        family=getattr(args, "family", "llama"),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, max_len),
    )
    return build_tiny_model(out_dir, **{**shape, **extra})


def load_aligned_and_transformers(path, max_model_len: int, dtype: str = "float32"):
    """The same checkpoint as the aligned trainer model (engine ``dtype``) and as a transformers
    model with ``dtype`` weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    aligned = AlignedCausalLM.from_pretrained(path, max_model_len=max_model_len, dtype=dtype)
    return aligned, AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))


def compare_with_transformers(args, aligned, hf, model_line: str) -> None:
    """Time the response-token logprobs of one random batch, forward and forward+backward, on
    both models alternately, at each thread count of :func:`timing.thread_counts`; print each
    phase's rows (minimum, median, spread, CPU time, ratios) beside the phase's target."""
    import torch

    from zero_mismatch_plugin.aligned import pack

    gen = torch.Generator().manual_seed(0)
    seq = args.prompt_len + args.response_len
    ids = torch.randint(0, args.vocab, (args.batch, seq), generator=gen)
    prompts = [row[: args.prompt_len].tolist() for row in ids]
    responses = [row[args.prompt_len :].tolist() for row in ids]
    batch = pack(prompts, responses)
    rows = torch.arange(args.prompt_len - 1, seq - 1)
    targets = ids[:, args.prompt_len :]

    def hf_logprobs():
        logits = hf(input_ids=ids).logits[:, rows]
        return logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]

    def aligned_logprobs():
        return aligned.token_logprobs(batch)

    # Same model, same batch: the two agree to round-off (sanity check of the comparison).
    with torch.no_grad():
        max_diff = (aligned_logprobs().view(args.batch, -1) - hf_logprobs()).abs().max().item()

    def forward(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    def forward_backward(model, fn):
        def run():
            model.zero_grad(set_to_none=True)
            fn().sum().backward()

        return run

    phases = {
        "forward": {"aligned": forward(aligned_logprobs), "transformers": forward(hf_logprobs)},
        "forward+backward": {"aligned": forward_backward(aligned, aligned_logprobs),
                             "transformers": forward_backward(hf, hf_logprobs)},
    }
    target_ratios = {"forward": 1.05, "forward+backward": 1.15}

    def measure_phases():
        for phase, contenders in phases.items():
            print_comparison(f"  {phase}", compare_sides(args, contenders), "transformers",
                             note=f"; target aligned/transformers {target_ratios[phase]:.2f}")

    print(f"model: {model_line}; batch {args.batch} x {seq} tokens; alternating order, {args.repeats} rounds "
          f"or more until the ratio settles; ratios: model / transformers")
    print(f"max |aligned - transformers| logprob: {max_diff:.3g}")
    for threads in thread_counts(args):
        print(f"torch threads {threads}:")
        at_threads(threads, measure_phases)


def main():
    args = parse_args()
    import torch

    print(host_line("before"), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_from_args(tmp, args, args.prompt_len + args.response_len)
        aligned, hf = load_aligned_and_transformers(path, args.prompt_len + args.response_len, args.dtype)
    hf.load_state_dict(aligned.state_dict(), strict=False)
    compare_with_transformers(
        args, aligned, hf,
        f"{args.family} layers={args.layers} hidden={args.hidden} intermediate={args.intermediate} "
        f"heads={args.heads}/{args.kv_heads} vocab={args.vocab}, {args.dtype}",
    )
    print(host_line("after"))


if __name__ == "__main__":
    main()
