"""GPU checks of the trainer-side batch invariance (and, where vLLM is installed, bf16 equality).

Run by ``scripts/gpu_check.sh``. Each part prints PASS / FAIL / NOT RUN with a reason, and the
summary goes to ``$OUT/gpu_check.json`` when ``OUT`` is set. Parts:

* ``kernels_match_reference``: the batch-invariant kernels compute the right numbers.
* ``rms_norm_batch_invariant`` / ``linear_batch_invariant`` / ``log_softmax_batch_invariant``:
  a row's bits do not depend on how many other rows share the call (fp32 and bf16).
* ``attention_prefill_vs_decode``: a query row gives the same bits in a packed prefill as in a
  single-row decode step, and alone as packed with other sequences.
* ``model_forward_batch_invariant``: a small Llama-shaped forward built from these kernels gives
  the same logprobs for a sequence alone, packed with others, and decoded token by token.
* ``torch_default_ops`` (information only): whether torch's default kernels are batch-variant
  on this device, which is what the invariant kernels are for.
* ``vllm_bf16_equality``: only where vLLM is installed — an engine rollout at bf16 in
  consistent mode and the aligned trainer's logprobs must be bitwise equal.

Overall: FAIL when a part failed; INCOMPLETE when a required part (every part but the
information-only one, and the vLLM equality) did not run or was not selected; PASS only when
every required part ran and passed. Exit status 0 / 1 / 2 for PASS / FAIL / INCOMPLETE.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

PASS, FAIL, NOT_RUN, INFO, INCOMPLETE = "PASS", "FAIL", "NOT RUN", "INFO", "INCOMPLETE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCOMPLETE: 2}
VLLM_PART = "vllm_bf16_equality"
GROUPS = ("kernels", "vllm")


def _load_kernels():
    try:
        from zero_mismatch_plugin.aligned import invariant_kernels

        return invariant_kernels
    except Exception:
        # The package's other modules may need dependencies this machine lacks: load the file.
        path = Path(__file__).with_name("invariant_kernels.py")
        spec = importlib.util.spec_from_file_location("zmrl_invariant_kernels", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


ik = _load_kernels()
# A dry run exercises this script's logic on CPU through Triton's interpreter
# (TRITON_INTERPRET=1) with every large dimension shrunk; it proves nothing about a GPU.
DRY_RUN = os.environ.get("ZMRL_GPU_CHECK_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
ROW_COUNTS = (1, 2, 3, 7, 16, 33, 64, 129, 257)


def _d(n: int) -> int:
    """A large dimension (rows, hidden, vocab, sequence length); shrunk in a dry run."""
    return max(n // 16, 8) if DRY_RUN else n


def _gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _rows_invariant(fn, x: torch.Tensor) -> tuple[bool, list[int]]:
    """Compare fn(x[:m]) with the first m rows of fn(x) for every m in ROW_COUNTS."""
    full = fn(x)
    bad = [m for m in ROW_COUNTS if m <= x.shape[0] and not torch.equal(fn(x[:m].contiguous()), full[:m])]
    return not bad, bad


# ----- parts -----------------------------------------------------------------------------------


def part_kernels_match_reference():
    g = _gen(0)
    errors = {}
    x = torch.randn(37, _d(4096), device=DEVICE, generator=g)
    w = torch.randn(_d(4096), device=DEVICE, generator=g)
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())
    errors["rms_norm"] = (ik.rms_norm(x, w, 1e-6).double() - ref).abs().max().item()
    a = torch.randn(37, _d(1024), device=DEVICE, generator=g)
    b = torch.randn(_d(512), _d(1024), device=DEVICE, generator=g)
    bias = torch.randn(_d(512), device=DEVICE, generator=g)
    ref = a.double() @ b.double().t() + bias.double()
    errors["linear_fp32"] = ((ik.linear(a, b, bias).double() - ref).abs().max() / ref.abs().max()).item()
    logits = torch.randn(9, _d(32000), device=DEVICE, generator=g) * 3
    errors["log_softmax"] = (ik.log_softmax(logits).double() - logits.double().log_softmax(-1)).abs().max().item()
    q = torch.randn(70, 8, 64, device=DEVICE, generator=g)
    k = torch.randn(70, 2, 64, device=DEVICE, generator=g)
    v = torch.randn(70, 2, 64, device=DEVICE, generator=g)
    pos = torch.arange(70, device=DEVICE)
    out = ik.attention(q, k, v, pos, torch.zeros_like(pos), 0.125).double()
    qs, ks, vs = q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1)
    ks, vs = ks.repeat_interleave(4, 0), vs.repeat_interleave(4, 0)
    s = (qs @ ks.transpose(1, 2) * 0.125).masked_fill(
        torch.ones(70, 70, dtype=torch.bool, device=DEVICE).triu(1), float("-inf")
    )
    ref = (s.softmax(-1) @ vs).transpose(0, 1)
    errors["attention"] = (out - ref).abs().max().item()
    tol = {"rms_norm": 1e-4, "linear_fp32": 1e-5, "log_softmax": 1e-4, "attention": 1e-4}
    ok = all(errors[k] < tol[k] for k in tol)
    return ok, {"max_errors": errors, "tolerances": tol}


def part_rms_norm_batch_invariant():
    details = {}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        g = _gen(1)
        x = torch.randn(_d(257), _d(4096), device=DEVICE, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(_d(4096), device=DEVICE, generator=g)).to(dtype)
        good, bad = _rows_invariant(lambda t: ik.rms_norm(t, w, 1e-6), x)
        details[str(dtype)] = {"invariant": good, "variant_row_counts": bad}
        ok &= good
    return ok, details


def part_linear_batch_invariant():
    details = {}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((_d(4096), _d(4096)), (_d(1024), _d(11008)), (_d(32000), _d(512))):
            g = _gen(2)
            x = torch.randn(_d(257), k, device=DEVICE, generator=g).to(dtype)
            w = (torch.randn(n, k, device=DEVICE, generator=g) / k**0.5).to(dtype)
            good, bad = _rows_invariant(lambda t: ik.linear(t, w), x)
            details[f"{dtype} N={n} K={k}"] = {"invariant": good, "variant_row_counts": bad}
            ok &= good
    return ok, details


def part_log_softmax_batch_invariant():
    g = _gen(3)
    x = torch.randn(_d(257), _d(151936), device=DEVICE, generator=g) * 4
    good, bad = _rows_invariant(ik.log_softmax, x)
    return good, {"invariant": good, "variant_row_counts": bad}


def part_attention_prefill_vs_decode():
    details = {}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        g = _gen(4)
        lens = [_d(37), _d(200), 1, _d(513)]
        t = sum(lens)
        q = torch.randn(t, 8, 128, device=DEVICE, generator=g).to(dtype)
        k = torch.randn(t, 2, 128, device=DEVICE, generator=g).to(dtype)
        v = torch.randn(t, 2, 128, device=DEVICE, generator=g).to(dtype)
        pos = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
        starts_list = [sum(lens[:i]) for i in range(len(lens))]
        starts = torch.cat([torch.full((n,), s) for n, s in zip(lens, starts_list)]).to(DEVICE)
        prefill = ik.attention(q, k, v, pos, starts, 128**-0.5)
        # Decode shape: one query row at a time against the keys written so far.
        decode_ok = all(
            torch.equal(ik.attention(q[i : i + 1], k, v, pos[i : i + 1], starts[i : i + 1], 128**-0.5), prefill[i : i + 1])
            for i in range(t)
        )
        # Batch composition: the long sequence alone (its own buffers) vs packed.
        s, n = starts_list[3], lens[3]
        alone = ik.attention(
            q[s : s + n].contiguous(), k[s : s + n].contiguous(), v[s : s + n].contiguous(),
            torch.arange(n, device=DEVICE), torch.zeros(n, dtype=torch.long, device=DEVICE), 128**-0.5,
        )  # fmt: skip
        alone_ok = torch.equal(alone, prefill[s : s + n])
        details[str(dtype)] = {"prefill_equals_decode": decode_ok, "alone_equals_packed": alone_ok}
        ok &= decode_ok and alone_ok
    return ok, details


class _TinyInvariantModel:
    """Llama-shaped forward from the invariant kernels; elementwise ops stay in torch."""

    def __init__(self, dtype, seed=5, layers=2, hidden=512, heads=8, kv_heads=4, inter=1408, vocab=4096):
        if DRY_RUN:
            hidden, heads, kv_heads, inter, vocab = 64, 2, 1, 96, 256
        g = _gen(seed)

        def w(*shape, scale=None):
            scale = scale or shape[-1] ** -0.5
            return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(dtype)

        self.dtype, self.heads, self.kv_heads = dtype, heads, kv_heads
        self.head_dim = hidden // heads
        self.embed = w(vocab, hidden, scale=1.0)
        self.layers = [
            dict(
                n1=(1 + 0.1 * torch.randn(hidden, device=DEVICE, generator=g)).to(dtype),
                qkv=w((heads + 2 * kv_heads) * self.head_dim, hidden),
                o=w(hidden, heads * self.head_dim),
                n2=(1 + 0.1 * torch.randn(hidden, device=DEVICE, generator=g)).to(dtype),
                gate_up=w(2 * inter, hidden),
                down=w(hidden, inter),
            )
            for _ in range(layers)
        ]
        self.norm = torch.ones(hidden, device=DEVICE, dtype=dtype)
        self.lm_head = w(vocab, hidden).float()
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, device=DEVICE).float() / self.head_dim))

    def _rope(self, x, positions):
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def new_cache(self, total_tokens):
        shape = (total_tokens, self.kv_heads, self.head_dim)
        return [
            (torch.zeros(shape, device=DEVICE, dtype=self.dtype), torch.zeros(shape, device=DEVICE, dtype=self.dtype))
            for _ in self.layers
        ]

    def logprobs(self, ids, positions, key_starts, rows, cache):
        """Full log-softmax rows for tokens ``ids`` stored at cache ``rows``."""
        h = self.embed[ids]
        hd, nh, nkv = self.head_dim, self.heads, self.kv_heads
        for layer, (kc, vc) in zip(self.layers, cache):
            x = ik.rms_norm(h, layer["n1"], 1e-6)
            qkv = ik.linear(x, layer["qkv"])
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.reshape(-1, nh, hd), positions)
            kc[rows] = self._rope(k.reshape(-1, nkv, hd), positions)
            vc[rows] = v.reshape(-1, nkv, hd)
            a = ik.attention(q.contiguous(), kc, vc, positions, key_starts, hd**-0.5)
            h = h + ik.linear(a.reshape(-1, nh * hd), layer["o"])
            x = ik.rms_norm(h, layer["n2"], 1e-6)
            gu = ik.linear(x, layer["gate_up"])
            g, u = gu.chunk(2, dim=-1)
            h = h + ik.linear(torch.nn.functional.silu(g) * u, layer["down"])
        x = ik.rms_norm(h, self.norm, 1e-6).float()
        return ik.log_softmax(ik.linear(x, self.lm_head))


def part_model_forward_batch_invariant():
    details = {}
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        model = _TinyInvariantModel(dtype)
        g = _gen(6)
        lens = [_d(33), _d(64), 7, _d(100)]
        seqs = [torch.randint(0, model.embed.shape[0], (n,), device=DEVICE, generator=g) for n in lens]
        starts_list = [sum(lens[:i]) for i in range(len(lens))]
        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(n, device=DEVICE) for n in lens])
        starts = torch.cat([torch.full((n,), s, device=DEVICE) for n, s in zip(lens, starts_list)])
        total = sum(lens)
        packed = model.logprobs(ids, pos, starts, torch.arange(total, device=DEVICE), model.new_cache(total))
        alone_ok = True
        decode_ok = True
        for seq, s in zip(seqs, starts_list):
            n = seq.numel()
            local_pos = torch.arange(n, device=DEVICE)
            zero = torch.zeros(n, dtype=torch.long, device=DEVICE)
            alone = model.logprobs(seq, local_pos, zero, local_pos, model.new_cache(n))
            alone_ok &= torch.equal(alone, packed[s : s + n])
            cache = model.new_cache(n)
            for t in range(n):
                row = model.logprobs(seq[t : t + 1], local_pos[t : t + 1], zero[t : t + 1], local_pos[t : t + 1], cache)
                decode_ok &= torch.equal(row, packed[s + t : s + t + 1])
        details[str(dtype)] = {"alone_equals_packed": alone_ok, "decode_equals_prefill": decode_ok}
        ok &= alone_ok and decode_ok
    return ok, details


def part_torch_default_ops():
    """Information only: are torch's default kernels batch-variant here?"""
    g = _gen(7)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(_d(257), _d(4096), device=DEVICE, generator=g).to(dtype)
        w = (torch.randn(_d(4096), _d(4096), device=DEVICE, generator=g) / 64).to(dtype)
        good, bad = _rows_invariant(lambda t: torch.nn.functional.linear(t, w), x)
        out[f"torch.linear {dtype}"] = {"invariant": good, "variant_row_counts": bad}
        good, bad = _rows_invariant(lambda t: t.float().pow(2).mean(-1, keepdim=True), x)
        out[f"torch.mean {dtype}"] = {"invariant": good, "variant_row_counts": bad}
    return None, out


def part_vllm_bf16_equality():
    """Engine rollout (bf16, consistent mode) vs the aligned trainer: must be bitwise equal."""
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from zero_mismatch_plugin.aligned import numerics

    numerics.set_mode(numerics.CONSISTENT)
    from vllm import LLM, SamplingParams

    from zero_mismatch_plugin.aligned import AlignedCausalLM, pack
    from zero_mismatch_plugin.aligned.runtime import engine_args_for, shutdown_engine
    from zero_mismatch_plugin.tiny_models import build_tiny_model, tiny_corpus

    details = {}
    ok = True
    engine_kwargs = dict(max_model_len=512, seed=0, gpu_memory_utilization=0.3)
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llama", "qwen3"):
            path = build_tiny_model(Path(tmp) / family, family=family, seed=11)
            llm = LLM(**engine_args_for(path, dtype="bfloat16", **engine_kwargs))
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path))
            prompts = [tok(line).input_ids[: 4 + i % 9] for i, line in enumerate(tiny_corpus(8, seed=3))]
            params = [
                SamplingParams(n=2, temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=0, seed=i)
                for i in range(len(prompts))
            ]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seq_prompts, responses, mu = [], [], []
            for p, o in zip(prompts, outs):
                for c in o.outputs:
                    seq_prompts.append(p)
                    responses.append(list(c.token_ids))
                    mu.extend(s[t].logprob for t, s in zip(c.token_ids, c.logprobs))
            mu = torch.tensor(mu, dtype=torch.float32)
            trainer = AlignedCausalLM.from_pretrained(path, dtype="bfloat16", **engine_kwargs)
            with torch.no_grad():
                lp = trainer.token_logprobs(pack(seq_prompts, responses)).float().cpu()
            equal = torch.equal(lp, mu)
            details[family] = {
                "tokens": mu.numel(),
                "bitwise_equal_fraction": (lp == mu).float().mean().item(),
                "max_abs_diff": (lp - mu).abs().max().item(),
                "attention_backend": trainer.attention.kernel.backend_name,
            }
            ok &= equal
            shutdown_engine(llm)
            del llm
    return ok, details


PARTS = [
    ("kernels_match_reference", part_kernels_match_reference),
    ("rms_norm_batch_invariant", part_rms_norm_batch_invariant),
    ("linear_batch_invariant", part_linear_batch_invariant),
    ("log_softmax_batch_invariant", part_log_softmax_batch_invariant),
    ("attention_prefill_vs_decode", part_attention_prefill_vs_decode),
    ("model_forward_batch_invariant", part_model_forward_batch_invariant),
    ("torch_default_ops", part_torch_default_ops),
]


# Parts that must run and pass for a complete check; torch_default_ops is information only.
KERNEL_PARTS = tuple(name for name, _ in PARTS if name != "torch_default_ops")
PART_NAMES = tuple(name for name, _ in PARTS) + (VLLM_PART,)


def required_parts(only: str | None) -> tuple[str, ...]:
    """The parts a run of ``--only`` group (None: both groups) must pass to be complete."""
    return {"kernels": KERNEL_PARTS, "vllm": (VLLM_PART,), None: KERNEL_PARTS + (VLLM_PART,)}[only]


def overall_status(parts: dict, required: tuple[str, ...]) -> str:
    """FAIL if any part failed, INCOMPLETE if a required part did not pass, else PASS."""
    if any(part["status"] == FAIL for part in parts.values()):
        return FAIL
    if any(parts.get(name, {}).get("status") != PASS for name in required):
        return INCOMPLETE
    return PASS


def summarize(work_dir, timed_out=()) -> dict:
    """One summary of both groups' JSON files (``scripts/gpu_check.sh``): a group without a
    result crashed, a group that timed out failed, whatever parts it finished before."""
    summary = {"parts": {}, "environment": {}}
    for group in GROUPS:
        path = Path(work_dir) / f"{group}.json"
        if path.exists():
            part = json.loads(path.read_text())
            summary["environment"].update(part.get("environment", {}))
            summary["parts"].update(part.get("parts", {}))
        else:
            summary["parts"][group] = {"status": FAIL, "details": "no result (crash or timeout)"}
        if group in timed_out:
            summary["parts"][f"{group}_timeout"] = {"status": FAIL, "details": "timed out"}
    summary["overall"] = overall_status(summary["parts"], required_parts(None))
    return summary


def _print_summary(summary) -> None:
    print("== summary ==")
    for name, part in summary["parts"].items():
        print(f"  {part['status']:10} {name}")
    if summary["overall"] == INCOMPLETE:
        missing = [n for n in required_parts(None) if summary["parts"].get(n, {}).get("status") != PASS]
        print(f"  did not run: {', '.join(missing)}")
    print("overall:", summary["overall"], flush=True)


def write_summary(summary, out):
    if not out:
        return
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    os.replace(tmp, out)


def run_parts(parts, summary, out=None):
    """Run each part; the summary is rewritten after every part so a timeout keeps results."""
    for name, fn in parts:
        t0 = time.time()
        try:
            ok, details = fn()
            status = INFO if ok is None else (PASS if ok else FAIL)
        except Exception as exc:
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


def _environment() -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dry_run_on_cpu": DRY_RUN,
        "triton": getattr(sys.modules.get("triton"), "__version__", None) if ik.HAVE_TRITON else None,
        "vllm_installed": importlib.util.find_spec("vllm") is not None,
    }


def _run_kernel_parts(summary, selected, out) -> None:
    if not (torch.cuda.is_available() or DRY_RUN):
        summary["parts"]["device"] = {"status": FAIL, "details": "no CUDA/ROCm device visible to torch"}
        print("[FAIL] device: no CUDA/ROCm device visible to torch", flush=True)
    elif not ik.HAVE_TRITON:
        summary["parts"]["triton"] = {"status": FAIL, "details": "triton is not importable"}
        print("[FAIL] triton: not importable", flush=True)
    else:
        run_parts([(name, fn) for name, fn in PARTS if name in selected], summary, out)


def _run_vllm_part(summary, selected, out) -> None:
    env = summary["environment"]
    if VLLM_PART not in selected:
        reason = "not selected (--parts)"
    elif not env["vllm_installed"]:
        reason = "vLLM is not installed"
    elif not torch.cuda.is_available() or DRY_RUN:
        reason = "no GPU (or dry run)"
    else:
        run_parts([(VLLM_PART, part_vllm_bf16_equality)], summary, out)
        return
    summary["parts"][VLLM_PART] = {"status": NOT_RUN, "details": reason}
    print(f"[{NOT_RUN}] {VLLM_PART}: {reason}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description="zero-mismatch GPU checks")
    parser.add_argument("--only", choices=GROUPS, default=None)
    parser.add_argument("--parts", type=_parts_list, default=PART_NAMES, metavar="NAME,..",
                        help="run only these parts (the result is then INCOMPLETE)")
    parser.add_argument("--json", default=None, help="write the summary here")
    parser.add_argument("--summarize", metavar="DIR", help="combine DIR/kernels.json and DIR/vllm.json (gpu_check.sh)")
    parser.add_argument("--timed-out", action="append", default=[], choices=GROUPS, help="with --summarize")
    args = parser.parse_args(argv)

    if args.summarize:
        summary = summarize(args.summarize, args.timed_out)
        _print_summary(summary)
        if os.environ.get("OUT"):
            write_summary(summary, os.path.join(os.environ["OUT"], "gpu_check.json"))
            print("wrote", os.path.join(os.environ["OUT"], "gpu_check.json"))
        return EXIT_CODES[summary["overall"]]

    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    summary = {"parts": {}, "environment": _environment()}
    print("environment:", json.dumps(summary["environment"]), flush=True)
    if args.only != "vllm":
        _run_kernel_parts(summary, args.parts, out)
    if args.only != "kernels":
        _run_vllm_part(summary, args.parts, out)

    summary["overall"] = overall_status(summary["parts"], required_parts(args.only))
    write_summary(summary, out)
    if out:
        print(f"summary written to {out}", flush=True)
    print(f"overall: {summary['overall']}", flush=True)
    return EXIT_CODES[summary["overall"]]


if __name__ == "__main__":
    sys.exit(main())
