"""Zero-mismatch GPU check: the product's own trainer path on a device (``scripts/gpu_check.sh``).

Every part runs the plugin's code, nothing written for the check. Each prints PASS / FAIL / NOT
RUN with a reason; the summary goes to ``--json`` (or ``$OUT/gpu_check.json``). Parts, by group:

``trainer`` (one process)
  * ``op_backward_float64`` (torch only): the op layer's analytic backward (attention, RMSNorm
    plain and fused, SiluAndMul, merged linear with bias) on the device vs float64 autograd.
  * ``aligned_forward_batch_invariant`` (vLLM): ``AlignedCausalLM`` (tiny Llama and Qwen3, in
    consistent mode, so its forwards are vLLM's batch-invariant kernels on a GPU): every
    sequence's logprobs alone, packed with the others and packed in reverse order are the same bits.
  * ``aligned_backward_float64`` (vLLM, transformers): the aligned model's gradient of a weighted
    sum of token logprobs vs float64 autograd through transformers with the same weights.
``engine`` (one process)
  * ``vllm_bf16_equality`` (vLLM, GPU): an engine rollout at bf16 in consistent mode and the
    aligned trainer's logprobs must be bitwise equal.

Overall: FAIL when a part failed; INCOMPLETE when a required part (every part) did not run or was
not selected; PASS only when every part ran and passed. Exit status 0 / 1 / 2 for PASS / FAIL /
INCOMPLETE. ``--device cpu`` is a dry run of the check's logic on the CPU (vLLM's CPU kernels);
it proves nothing about a GPU, and the engine part does not run in it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

PASS, FAIL, NOT_RUN, INCOMPLETE = "PASS", "FAIL", "NOT RUN", "INCOMPLETE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCOMPLETE: 2}
GROUPS = {
    "trainer": ("op_backward_float64", "aligned_forward_batch_invariant", "aligned_backward_float64"),
    "engine": ("vllm_bf16_equality",),
}
PART_NAMES = tuple(name for parts in GROUPS.values() for name in parts)
# Relative L2 error allowed between an fp32 analytic gradient and float64 autograd: fp32
# round-off is ~1e-6 here, a wrong backward term O(1) (the tests use the same bounds).
OP_GRAD_REL_TOL = 1e-5
MODEL_GRAD_REL_TOL = 1e-4
FAMILIES = ("llama", "qwen3")
ENGINE_KWARGS = dict(max_model_len=512, seed=0, gpu_memory_utilization=0.3)


class NotRunnable(Exception):
    """A part cannot run on this machine; the message says what is missing."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _require(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise NotRunnable(f"{module} is not installed ({why})")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ----- parts -----------------------------------------------------------------------------------


def op_backward_float64(device: str):
    """The op layer's backward formulas on ``device`` vs float64 autograd of the op's formula."""
    from zero_mismatch_plugin.aligned import ops

    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g)

    def reference_grads(fn, inputs, cotangent):
        leaves = [x.detach().double().requires_grad_() for x in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, cotangent.double())

    errors = {}
    seq_lens, heads, kv_heads, head_dim = [37, 5, 64], 8, 2, 32
    t = sum(seq_lens)
    q, k, v, cot = randn(t, heads * head_dim), randn(t, kv_heads * head_dim), randn(t, kv_heads * head_dim), randn(t, heads * head_dim)
    scale = head_dim**-0.5

    def attention(q, k, v):
        out, start = [], 0
        for n in seq_lens:
            qs = q[start : start + n].view(n, heads, head_dim).transpose(0, 1)
            ks = k[start : start + n].view(n, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            vs = v[start : start + n].view(n, kv_heads, head_dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            s = (qs @ ks.transpose(1, 2) * scale).masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            out.append((s.softmax(-1) @ vs).transpose(0, 1).reshape(n, -1))
            start += n
        return torch.cat(out)

    got = ops.attention_backward(q, k, v, cot, seq_lens, heads, kv_heads, head_dim, scale)
    ref = reference_grads(attention, (q, k, v), cot)
    errors["attention"] = max(_rel(a, b) for a, b in zip(got, ref))

    x, r, w, cot = randn(67, 256), randn(67, 256), 1 + 0.1 * randn(256), randn(67, 256)
    eps = 1e-6

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    ctx = SimpleNamespace(saved_tensors=(x, w), eps=eps, scale_offset=0.0)  # a plain RMSNorm (not Gemma's 1 + w)
    got = ops._RMSNormFn.backward(ctx, cot)[:2]
    errors["rms_norm"] = max(_rel(a, b) for a, b in zip(got, reference_grads(rms, (x, w), cot)))
    ctx = SimpleNamespace(saved_tensors=(x, r, w), eps=eps, scale_offset=0.0)
    got = ops._FusedAddRMSNormFn.backward(ctx, cot, None)[::2][:2]  # d/dx (== d/dresidual), d/dw
    errors["fused_add_rms_norm"] = max(_rel(a, b) for a, b in zip(got, reference_grads(lambda x, w: rms(x + r.double(), w), (x, w), cot)))

    x, cot = randn(67, 2 * 192), randn(67, 192)
    got = ops._SiluAndMulFn.backward(SimpleNamespace(saved_tensors=(x,)), cot)[0]
    ref = reference_grads(lambda x: torch.nn.functional.silu(x[:, :192]) * x[:, 192:], (x,), cot)[0]
    errors["silu_and_mul"] = _rel(got, ref)

    parts = [randn(96, 128), randn(32, 128)]
    biases = [randn(96), randn(32)]
    x, cot = randn(67, 128), randn(67, 128)
    linear = SimpleNamespace(weights=parts, biases=biases, out_sizes=[96, 32], has_bias=True)
    weight = torch.cat(parts)
    ctx = SimpleNamespace(saved_tensors=(x, weight), linear=linear)
    got = ops._LinearFn.backward(ctx, cot)
    got = (got[0], *got[2:])
    ref = reference_grads(lambda x, w0, w1, b0, b1: x @ torch.cat([w0, w1]).t() + torch.cat([b0, b1]), (x, *parts, *biases), cot)
    errors["merged_linear"] = max(_rel(a, b) for a, b in zip(got, ref))

    return all(e < OP_GRAD_REL_TOL for e in errors.values()), {"relative_errors": errors, "tolerance": OP_GRAD_REL_TOL}


def _tiny_models(tmp: Path):
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    return {family: build_tiny_model(tmp / family, family=family, seed=11) for family in FAMILIES}


def _random_sequences(vocab_size: int, lens, seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n, _ in lens]
    responses = [torch.randint(0, vocab_size, (r,), generator=gen).tolist() for _, r in lens]
    return prompts, responses


def _consistent_mode():
    from zero_mismatch_plugin.aligned import numerics

    numerics.set_mode(numerics.CONSISTENT)


def aligned_forward_batch_invariant(device: str):
    """Per sequence: alone == packed with the others == packed in reverse order, bitwise."""
    _require("vllm", "the op layer's forwards are vLLM's kernels")
    _consistent_mode()
    from zero_mismatch_plugin.aligned import pack
    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    dtypes = ("bfloat16", "float32") if device != "cpu" else ("float32",)
    lens = [(5, 28), (40, 24), (1, 6), (17, 83)]  # (prompt, response) tokens
    details, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for family, path in _tiny_models(Path(tmp)).items():
            for dtype in dtypes:
                trainer = AlignedCausalLM.from_pretrained(path, dtype=dtype, **ENGINE_KWARGS)
                prompts, responses = _random_sequences(trainer.vocab_size, lens, seed=3)
                with torch.no_grad():
                    packed = trainer.token_logprobs(pack(prompts, responses)).cpu().split([r for _, r in lens])
                    reverse = trainer.token_logprobs(pack(prompts[::-1], responses[::-1])).cpu().split([r for _, r in lens][::-1])[::-1]
                    alone = [trainer.token_logprobs(pack([p], [r])).cpu() for p, r in zip(prompts, responses)]
                alone_equal = [torch.equal(a, b) for a, b in zip(alone, packed)]
                order_equal = [torch.equal(a, b) for a, b in zip(reverse, packed)]
                details[f"{family} {dtype}"] = {
                    "alone_equals_packed": alone_equal,
                    "reverse_order_equals_packed": order_equal,
                    "max_abs_diff_alone": max((a - b).abs().max().item() for a, b in zip(alone, packed)),
                    "attention_backend": trainer.attention.kernel.backend_name,
                }
                ok &= all(alone_equal) and all(order_equal)
                del trainer
    return ok, details


def aligned_backward_float64(device: str):
    """The aligned model's fp32 gradient vs float64 autograd through transformers, per parameter."""
    _require("vllm", "the op layer's forwards are vLLM's kernels")
    _require("transformers", "the float64 reference model")
    _consistent_mode()
    from transformers import AutoModelForCausalLM

    from zero_mismatch_plugin.aligned import pack

    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM

    lens = [(6, 20), (13, 31), (2, 9)]
    details, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for family, path in _tiny_models(Path(tmp)).items():
            trainer = AlignedCausalLM.from_pretrained(path, dtype="float32", **ENGINE_KWARGS)
            prompts, responses = _random_sequences(trainer.vocab_size, lens, seed=5)
            batch = pack(prompts, responses)
            coeffs = torch.randn(batch.target_ids.numel(), generator=torch.Generator().manual_seed(0))
            (trainer.token_logprobs(batch).cpu() * coeffs).sum().backward()

            reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).to(device)
            reference.get_input_embeddings().padding_idx = None  # vLLM's embedding has no pad row
            state = {k: v.detach().double() for k, v in trainer.state_dict().items()}
            reference.load_state_dict(state, strict=False)
            total, start, row = 0.0, 0, 0
            for n, (p, r) in zip(batch.seq_lens, lens):
                ids = batch.input_ids[start : start + n].to(device)
                logprobs = reference(input_ids=ids[None]).logits[0, p - 1 : p - 1 + r].log_softmax(-1)
                labels = batch.target_ids[row : row + r].to(device)
                weights = coeffs[row : row + r].double().to(device)
                total = total + (logprobs.gather(-1, labels[:, None])[:, 0] * weights).sum()
                start, row = start + n, row + r
            total.backward()
            grads = dict(reference.named_parameters())
            errors = {name: _rel(param.grad, grads[name].grad) for name, param in trainer.named_parameters()}
            worst = max(errors, key=errors.get)
            details[family] = {"worst_parameter": worst, "worst_relative_error": errors[worst], "tolerance": MODEL_GRAD_REL_TOL}
            ok &= errors[worst] < MODEL_GRAD_REL_TOL
            del trainer, reference
    return ok, details


def vllm_bf16_equality(device: str):
    """Engine rollout (bf16, consistent mode) vs the aligned trainer: must be bitwise equal."""
    _require("vllm", "the engine")
    if device == "cpu":
        raise NotRunnable("runs on a GPU only (--device cpu is a dry run of the check's logic)")
    _consistent_mode()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from zero_mismatch_plugin.aligned import pack

    from zero_mismatch_plugin.faces.aligned_model import AlignedCausalLM
    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine
    from zero_mismatch_plugin.tools.tiny_models import tiny_corpus

    details, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for family, path in _tiny_models(Path(tmp)).items():
            llm = LLM(**engine_args_for(path, dtype="bfloat16", **ENGINE_KWARGS))
            tok = AutoTokenizer.from_pretrained(str(path))
            prompts = [tok(line).input_ids[: 4 + i % 9] for i, line in enumerate(tiny_corpus(8, seed=3))]
            params = [SamplingParams(n=2, temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=0, seed=i) for i in range(len(prompts))]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seq_prompts, responses, mu = [], [], []
            for p, o in zip(prompts, outs):
                for c in o.outputs:
                    seq_prompts.append(p)
                    responses.append(list(c.token_ids))
                    mu.extend(s[t].logprob for t, s in zip(c.token_ids, c.logprobs))
            mu = torch.tensor(mu, dtype=torch.float32)
            trainer = AlignedCausalLM.from_pretrained(path, dtype="bfloat16", **ENGINE_KWARGS)
            with torch.no_grad():
                lp = trainer.token_logprobs(pack(seq_prompts, responses)).float().cpu()
            details[family] = {
                "tokens": mu.numel(),
                "bitwise_equal_fraction": (lp == mu).float().mean().item(),
                "max_abs_diff": (lp - mu).abs().max().item(),
                "attention_backend": trainer.attention.kernel.backend_name,
            }
            ok &= torch.equal(lp, mu)
            shutdown_engine(llm)
            del llm, trainer
    return ok, details


PARTS = {
    "op_backward_float64": op_backward_float64,
    "aligned_forward_batch_invariant": aligned_forward_batch_invariant,
    "aligned_backward_float64": aligned_backward_float64,
    "vllm_bf16_equality": vllm_bf16_equality,
}


# ----- the contract: PASS / FAIL / INCOMPLETE --------------------------------------------------


def required_parts(only: str | None) -> tuple[str, ...]:
    """The parts a run of group ``only`` (None: every group) must pass to be complete."""
    return GROUPS[only] if only else PART_NAMES


def overall_status(parts: dict, required: tuple[str, ...]) -> str:
    """FAIL if any part failed, INCOMPLETE if a required part did not pass, else PASS."""
    if any(part["status"] == FAIL for part in parts.values()):
        return FAIL
    if any(parts.get(name, {}).get("status") != PASS for name in required):
        return INCOMPLETE
    return PASS


def summarize(work_dir, timed_out=()) -> dict:
    """One summary of the groups' JSON files (``gpu_check.sh``): a group without a result
    crashed, a group that timed out failed, whatever parts it finished before."""
    summary = {"parts": {}, "environment": {}}
    for group in GROUPS:
        path = Path(work_dir) / f"{group}.json"
        if path.exists():
            result = json.loads(path.read_text())
            summary["environment"].update(result.get("environment", {}))
            summary["parts"].update(result.get("parts", {}))
        else:
            summary["parts"][group] = {"status": FAIL, "details": "no result (crash or timeout)"}
        if group in timed_out:
            summary["parts"][f"{group}_timeout"] = {"status": FAIL, "details": "timed out"}
    summary["overall"] = overall_status(summary["parts"], required_parts(None))
    return summary


def print_summary(summary, required, label="overall") -> None:
    print("== summary ==" if label == "overall" else f"== {label} ==")
    for name, part in summary["parts"].items():
        reason = f" ({part['details']})" if part["status"] == NOT_RUN else ""
        print(f"  {part['status']:10} {name}{reason}")
    if summary["overall"] == INCOMPLETE:
        missing = [n for n in required if summary["parts"].get(n, {}).get("status") != PASS]
        print(f"  did not run: {', '.join(missing)}")
    print(f"{label}:", summary["overall"], flush=True)


def write_summary(summary, out) -> None:
    if not out:
        return
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    os.replace(tmp, out)


def run_parts(names, device, summary, out=None) -> None:
    """Run each part; the summary is rewritten after every part so a timeout keeps results."""
    for name in names:
        t0 = time.time()
        try:
            ok, details = PARTS[name](device)
            status = PASS if ok else FAIL
        except NotRunnable as reason:
            status, details = NOT_RUN, str(reason)
        except Exception as exc:  # noqa: BLE001 - a crashing part is a failed part, with its trace
            status, details = FAIL, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        summary["parts"][name] = {"status": status, "seconds": round(time.time() - t0, 2), "details": details}
        print(f"[{status}] {name} ({time.time() - t0:.1f}s): {json.dumps(details, default=str)[:2000]}", flush=True)
        write_summary(summary, out)


def _parts_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PART_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown parts {unknown}; choose from {', '.join(PART_NAMES)}")
    return names


def _environment(device: str) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if cuda and device != "cpu" else "cpu",
        "vllm_installed": vllm_installed(),
        "transformers_installed": importlib.util.find_spec("transformers") is not None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="zero-mismatch GPU check (the product's trainer path on a device)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of the check's logic")
    parser.add_argument("--only", choices=tuple(GROUPS), default=None, help="run one group of parts")
    parser.add_argument("--parts", type=_parts_list, default=PART_NAMES, metavar="NAME,..",
                        help="run only these parts (the result is then INCOMPLETE at best)")
    parser.add_argument("--json", default=None, help="write the summary here (default: $OUT/gpu_check.json)")
    parser.add_argument("--summarize", metavar="DIR", help="combine DIR/<group>.json (gpu_check.sh)")
    parser.add_argument("--timed-out", action="append", default=[], choices=tuple(GROUPS), help="with --summarize")
    args = parser.parse_args(argv)
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)

    if args.summarize:
        summary = summarize(args.summarize, args.timed_out)
        print_summary(summary, required_parts(None))
        write_summary(summary, out)
        return EXIT_CODES[summary["overall"]]

    summary = {"parts": {}, "environment": _environment(args.device)}
    print("environment:", json.dumps(summary["environment"]), flush=True)
    if args.device != "cpu" and not torch.cuda.is_available():
        summary["parts"]["device"] = {"status": FAIL, "details": f"--device {args.device}: no CUDA/ROCm device visible to torch"}
        print("[FAIL] device: no CUDA/ROCm device visible to torch", flush=True)
    else:
        selected = [n for n in required_parts(args.only) if n in args.parts]
        for name in required_parts(args.only):
            if name not in selected:
                summary["parts"][name] = {"status": NOT_RUN, "details": "not selected (--parts)"}
        run_parts(selected, args.device, summary, out)
    summary["overall"] = overall_status(summary["parts"], required_parts(args.only))
    write_summary(summary, out)
    # One group's result is not the check's: gpu_check.sh sums the groups up (--summarize).
    print_summary(summary, required_parts(args.only), f"group {args.only}" if args.only else "overall")
    return EXIT_CODES[summary["overall"]]


if __name__ == "__main__":
    sys.exit(main())
