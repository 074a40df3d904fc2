"""Aligned LoRA (vLLM's LoRA arithmetic) vs PEFT's LoRA, and adapter sync vs full-weight sync.

1. Forward+backward of the response-token logprobs of one batch: the aligned model with a
   frozen base and a trainable adapter (vLLM's kernels and punica LoRA ops, analytic backward
   for A and B) against transformers + PEFT (unmerged LoRA, autograd) on the same weights.
2. Weight sync into a LoRA-enabled engine: the adapter (written in PEFT's format, loaded by a
   new ``LoRARequest``) against the full model (``sync_weights``: every base tensor through
   vLLM's weight loader). Each is timed up to the end of a one-token request that uses the
   new weights, so both include what the engine does before it can serve them.

Timings alternate between the two sides and repeat until the ratio settles (up to
``--max-repeats``). Prints the host's load, CPUs and torch threads before and after, and per side:
minimum and median wall ms, spread ((p75 - p25) / median), median CPU ms of this process, and the
ratio of the minima and of the medians; rows are flagged UNRELIABLE when the host was loaded or the
ratio did not settle. Part 1 runs at the default torch thread count and again at one thread (the
one-thread variant); part 2 at the default count only: the engine's threads are its own process's,
which this process's torch thread count does not set.

    python benchmarks/bench_lora.py [--layers 4 --hidden 512 --rank 32 ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_aligned_forward import (add_run_arguments, add_shape_arguments, build_model_from_args, compare_sides,
                                   print_comparison)
from timing import at_threads, host_line, thread_counts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ZMRL_NUMERICS", "consistent")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p, ("llama", "qwen2", "qwen3"))
    p.add_argument("--rank", type=int, default=32)
    add_run_arguments(p, response_len=112, repeats=5, warmup=1, threads=None)
    p.add_argument("--skip-sync", action="store_true", help="only the forward+backward comparison")
    return p.parse_args()


def main():
    args = parse_args()
    print(host_line("before"), flush=True)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from zero_mismatch_plugin.aligned import pack

    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter

    seq = args.prompt_len + args.response_len
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model_from_args(os.path.join(tmp, "model"), args, seq)
        adapter_dir = build_adapter(os.path.join(tmp, "adapter"), path, r=args.rank, lora_alpha=2 * args.rank)
        lora_args = lora_engine_args(adapter_dir)
        aligned = AlignedCausalLM.from_pretrained(path, lora_dir=adapter_dir, max_model_len=seq, **lora_args)
        base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)

        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (args.batch, seq), generator=gen)
        batch = pack([r[: args.prompt_len].tolist() for r in ids], [r[args.prompt_len :].tolist() for r in ids])
        rows = torch.arange(args.prompt_len - 1, seq - 1)
        targets = ids[:, args.prompt_len :]

        def peft_logprobs():
            logits = peft(input_ids=ids).logits[:, rows]
            return logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]

        with torch.no_grad():
            max_diff = (aligned.token_logprobs(batch).view(args.batch, -1) - peft_logprobs()).abs().max().item()

        def aligned_step():
            aligned.zero_grad(set_to_none=True)
            aligned.token_logprobs(batch).sum().backward()

        def peft_step():
            peft.zero_grad(set_to_none=True)
            peft_logprobs().sum().backward()

        adapter_params = sum(p.numel() for p in aligned.lora.parameters())
        base_params = sum(p.numel() for n, p in aligned.named_parameters() if not n.startswith("lora."))
        print(
            f"model: {args.family} layers={args.layers} hidden={args.hidden} intermediate={args.intermediate} "
            f"heads={args.heads}/{args.kv_heads} vocab={args.vocab}; LoRA r={args.rank} on every linear "
            f"({adapter_params} adapter / {base_params} base parameters); batch {args.batch} x {seq} tokens; "
            f"alternating order, {args.repeats} rounds or more until the ratio settles"
        )
        print(f"max |aligned LoRA - PEFT LoRA| logprob: {max_diff:.3g}")
        for threads in thread_counts(args):
            comparison = at_threads(threads, compare_sides, args, {"aligned": aligned_step, "PEFT": peft_step})
            print_comparison(f"LoRA forward+backward, torch threads {threads}", comparison, "PEFT")
        if not args.skip_sync:
            sync_times(args, path, aligned, lora_args, seq, tmp)
    print(host_line("after"))


def sync_times(args, path, aligned, lora_args, seq, tmp):
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine
    from zero_mismatch_plugin.aligned.weight_sync import load_named_weights

    llm = LLM(**engine_args_for(path, max_model_len=seq, seed=0, **lora_args))
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    prompt = [{"prompt_token_ids": list(range(1, 9))}]
    versions = iter(range(1, 10_000))
    base_weights = [
        (n, p.detach()) for n, p in aligned.named_parameters() if not n.startswith("lora.")
    ]

    def adapter_sync():
        v = next(versions)
        out = aligned.save_adapter(os.path.join(tmp, f"adapter-v{v}"))
        llm.generate(prompt, params, lora_request=LoRARequest(f"v{v}", v, str(out)), use_tqdm=False)

    def full_sync():
        load_named_weights(llm, base_weights)
        llm.generate(prompt, params, use_tqdm=False)

    try:
        comparison = compare_sides(args, {"adapter": adapter_sync, "full weights": full_sync})
    finally:
        shutdown_engine(llm)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    print_comparison(
        f"sync + 1-token request (adapter {size(list(aligned.lora.parameters())) / 2**20:.2f} MiB vs full "
        f"{size([t for _, t in base_weights]) / 2**20:.2f} MiB), torch threads {torch.get_num_threads()}",
        comparison, "full weights")


if __name__ == "__main__":
    main()
