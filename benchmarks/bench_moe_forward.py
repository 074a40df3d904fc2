"""Aligned Mixture-of-Experts forward (and forward+backward) vs transformers' MoE forward, same model/batch.

Both compute the per-token logprobs of the response tokens of the same batch: the aligned model
over the packed sequences through vLLM's kernels (its router and fused-experts layer included),
transformers over the same sequences as a [batch, length] tensor with its default experts
implementation. Default shape: 8 experts, top-2, hidden 512, 4 layers, 8 x 256 tokens. Prints the
median time of each and the ratio of medians, side by side.

    python benchmarks/bench_moe_forward.py [--experts 8 --top-k 2 --layers 4 --hidden 512 ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench_aligned_forward import median_times  # the same alternating timing

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ZMRL_NUMERICS", "consistent")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=512, help="expert width (moe_intermediate_size)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=240)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    return p.parse_args()


def main():
    args = parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from zero_mismatch_plugin.aligned import AlignedCausalLM, pack
    from zero_mismatch_plugin.tiny_models import build_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    head_dim = args.hidden // args.heads
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            tmp,
            family=args.family,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            moe_intermediate_size=args.intermediate,
            shared_expert_intermediate_size=args.intermediate,
            num_experts=args.experts,
            top_k=args.top_k,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            head_dim=head_dim,
            vocab_size=args.vocab,
            max_position_embeddings=max(512, args.prompt_len + args.response_len),
        )
        aligned = AlignedCausalLM.from_pretrained(path, max_model_len=args.prompt_len + args.response_len)
        # The checkpoint both load: the same weights (transformers fuses the experts itself).
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)

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

    results = {}
    for label, a_fn, h_fn in (
        ("forward", forward(aligned_logprobs), forward(hf_logprobs)),
        (
            "forward+backward",
            forward_backward(aligned, aligned_logprobs),
            forward_backward(hf, hf_logprobs),
        ),
    ):
        results[label] = median_times(a_fn, h_fn, args.repeats, args.warmup)

    print(
        f"model: {args.family} experts={args.experts} top-{args.top_k} layers={args.layers} "
        f"hidden={args.hidden} expert width={args.intermediate} heads={args.heads}/{args.kv_heads} "
        f"vocab={args.vocab}; "
        f"batch {args.batch} x {seq} tokens; torch threads {torch.get_num_threads()}; "
        f"median of {args.repeats}, timed alternately; "
        f"host ISA {torch.backends.cpu.get_cpu_capability()} (the figures depend on it)"
    )
    print(f"max |aligned - transformers| logprob: {max_diff:.3g}")
    print(f"{'':18}{'aligned (s)':>14}{'transformers (s)':>18}{'ratio':>9}{'target':>9}")
    targets_ratio = {"forward": 1.05, "forward+backward": 1.15}
    for label, (a, h) in results.items():
        print(f"{label:18}{a:14.4f}{h:18.4f}{a / h:9.3f}{targets_ratio[label]:9.2f}")


if __name__ == "__main__":
    main()
