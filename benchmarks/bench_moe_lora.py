"""LoRA on MoE experts: what the LoRA-capable CPU experts cost against vLLM's fused CPU experts,
and the aligned expert-LoRA forward+backward against a plain torch one.

One MoE layer of a tiny Qwen3-MoE (default 8 experts, top-2, hidden 512, expert width 512) on
``--tokens`` tokens, the router logits fixed:

1. Engine-side forward, no adapter: vLLM's ``_C.cpu_fused_moe`` (what an engine without LoRA runs)
   against the plugin's LoRA-capable CPU experts (what every request of an MoE model runs once
   LoRA is enabled, base requests included).
2. The same experts with an adapter (rank ``--rank`` on every expert's gate, up and down): the
   forward the engine and the aligned trainer run, against the fused experts without adapter.
3. Forward+backward with the adapter: the aligned MoE-LoRA op (vLLM's experts forward, fp32 torch
   backward for the input, the router logits and A, B) against a plain torch forward+backward of
   the same layer (``experts_with_lora`` under autograd: a PEFT-style unmerged LoRA on each expert).

Timings alternate between the two sides of each comparison and repeat until the ratio settles (up
to ``--max-repeats``). Prints the host's load, CPUs and torch threads before and after; then, at
the default torch thread count (or ``--threads``) and again at one thread (all three comparisons
have the one-thread variant), per side: minimum and median wall ms, spread ((p75 - p25) / median),
median CPU ms of this process, and the ratio first / second of the minima and of the medians; rows
are flagged UNRELIABLE when the host was loaded or the ratio did not settle.

    python benchmarks/bench_moe_lora.py [--tokens 2048 --experts 8 --top-k 2 --rank 32 ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_aligned_forward import add_run_arguments, compare_sides, print_comparison
from timing import at_threads, host_line, thread_counts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ZMRL_NUMERICS", "consistent")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rank", type=int, default=32)
    add_run_arguments(p, batch=None, prompt_len=None, response_len=None)
    return p.parse_args()


def main():
    args = parse_args()
    print(host_line("before"), flush=True)
    import torch

    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.aligned.lora.names import EXPERT_TARGETS
    from zero_mismatch_plugin.aligned.lora.peft import lora_engine_args
    from zero_mismatch_plugin.aligned.lora.adapter import build_adapter
    from zero_mismatch_plugin.aligned.moe import experts_with_lora, routing_weights
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    torch.set_num_threads(args.threads or torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            os.path.join(tmp, "model"), family="qwen3_moe", seed=0, hidden_size=args.hidden,
            num_hidden_layers=1, num_experts=args.experts, top_k=args.top_k,
            moe_intermediate_size=args.expert_width, num_attention_heads=8, num_key_value_heads=4,
            head_dim=args.hidden // 8,
        )
        adapter_dir = build_adapter(os.path.join(tmp, "adapter"), path, r=args.rank, lora_alpha=2 * args.rank,
                                    targets=EXPERT_TARGETS)
        plain = AlignedCausalLM.from_pretrained(path, max_model_len=256)
        lora = AlignedCausalLM.from_pretrained(path, lora_dir=adapter_dir, max_model_len=256,
                                               **lora_engine_args(adapter_dir))
    fused, capable = plain.layer_ops[0]["experts"], lora.layer_ops[0]["experts"]
    with_adapter = lora.lora_ops[0]["experts"]

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    logits = torch.randn(args.tokens, args.experts, generator=gen)

    def forward(op):
        def run():
            with torch.no_grad():
                op(x, logits)
        return run

    def aligned_step():
        xs, ls = x.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        lora.zero_grad(set_to_none=True)
        with_adapter(xs, ls).sum().backward()

    # The torch reference on the same experts and adapter (the choice of experts taken from the
    # aligned op's forward, as its own backward does).
    with torch.no_grad():
        with_adapter(x, logits)
    ids = capable.last_topk_ids.long()
    gate, up, down = (list(w) for w in capable.expert_weights([p.detach() for p in capable.params]))
    params = [p.detach().clone().requires_grad_(True) for p in with_adapter.params]

    def torch_step():
        xs, ls = x.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        weights = routing_weights(ls, ids, with_adapter.moe)
        out = experts_with_lora(xs, weights, ids, gate, up, down, with_adapter.lora_weights(params),
                                with_adapter.scaling)
        torch.autograd.grad(out.sum(), [xs, ls, *params])

    comparisons = {
        "no adapter": {"LoRA-capable experts": forward(capable), "fused experts": forward(fused)},
        "adapter forward": {"LoRA-capable + adapter": forward(with_adapter), "fused (no adapter)": forward(fused)},
        "adapter forward+backward": {"aligned": aligned_step, "torch autograd": torch_step},
    }
    print(
        f"one Qwen3-MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert width "
        f"{args.expert_width}, {args.tokens} tokens; LoRA r={args.rank} (alpha {2 * args.rank}) on every expert's "
        f"gate, up, down; alternating order, {args.repeats} rounds or more until the ratio settles; "
        f"ratios: row / the second row"
    )

    def measure_all():
        for title, contenders in comparisons.items():
            print_comparison(f"  {title}", compare_sides(args, contenders), list(contenders)[-1])

    for threads in thread_counts(args):
        print(f"torch threads {threads}:")
        at_threads(threads, measure_all)
    print(host_line("after"))


if __name__ == "__main__":
    main()
