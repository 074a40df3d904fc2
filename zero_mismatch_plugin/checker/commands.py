"""Command-line handlers of ``zmrl check`` and ``zmrl bisect`` (argument parsing is in ``cli``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import engine as eng
from .backends import BackendUnavailable, load_backend
from .checks import CHECK_NAMES, CheckOptions, count_steps, run_checks

# Ops listed after the first differing one in the bisect table (the rest are consequences).
OPS_SHOWN_AFTER_FIRST = 3
DEFAULT_MAX_MODEL_LEN = 2048


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def resolve_max_model_len(model_dir, requested: int | None) -> int:
    """``requested``, or the smaller of 2048 and the checkpoint's own maximum."""
    if requested:
        return requested
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        limit = int(config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)
    except (OSError, ValueError):
        limit = DEFAULT_MAX_MODEL_LEN
    return min(DEFAULT_MAX_MODEL_LEN, limit)


def apply_numerics(mode: str | None) -> str:
    """Select the numerics mode for both sides before anything vLLM starts (default consistent)."""
    from zero_mismatch_plugin.aligned.numerics import CONSISTENT, MODE_ENV, set_mode

    mode = mode or os.environ.get(MODE_ENV) or CONSISTENT
    set_mode(mode)
    return mode


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, disable=quiet, dynamic_ncols=True, leave=False)


def _write_json(path: str, payload: dict) -> None:
    if path == "-":
        print(json.dumps(payload, indent=2))
        return
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)


def format_check_table(results, skipped, header: str) -> str:
    width = max(len(name) for name in CHECK_NAMES)
    lines = [header, f"{'check'.ljust(width)}  result  figures", f"{'-' * width}  ------  -------"]
    for name in CHECK_NAMES:
        if name in results:
            r = results[name]
            lines.append(f"{name.ljust(width)}  {'PASS' if r.passed else 'FAIL':6s}  {r.summary}")
        elif name in skipped:
            lines.append(f"{name.ljust(width)}  {'skip':6s}  not run: {skipped[name]}")
    failed = [n for n, r in results.items() if not r.passed]
    lines.append("")
    lines.append(
        f"{len(results) - len(failed)}/{len(results)} checks passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return "\n".join(lines)


def check_command(args) -> int:
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
        if args.num_prompts < 1 or args.max_tokens < 1:
            raise ValueError("--num-prompts and --max-tokens must be at least 1")
        mode = apply_numerics(args.numerics)
        max_model_len = resolve_max_model_len(args.model, args.max_model_len)
        backend = load_backend(args.trainer, args.model, max_model_len=max_model_len, seed=args.seed)
        prompts = eng.load_prompts(args.model, args.prompts, args.num_prompts)
    except (BackendUnavailable, ValueError, OSError) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    options = CheckOptions(
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        batch_sizes=batch_sizes,
        full_vocab=args.full_vocab,
        max_model_len=max_model_len,
    )
    with eng.open_engine(args.model, max_model_len, seed=args.seed, full_vocab=args.full_vocab) as llm:
        progress = _progress(count_steps(options, len(prompts)), args.quiet)
        try:
            results, skipped = run_checks(llm, backend, prompts, options, progress)
        finally:
            progress.close()
    header = (
        f"zmrl check: {args.model} | trainer {args.trainer} | numerics {mode} | "
        f"{len(prompts)} prompts x {args.max_tokens} tokens, T=1"
    )
    if args.json != "-":
        print(format_check_table(results, skipped, header))
    if args.json:
        try:
            _write_json(args.json, {name: r.as_dict() for name, r in results.items()})
        except OSError as error:
            print(f"ERROR: cannot write {args.json}: {error}", file=sys.stderr)
            return 2
        if args.json != "-":
            print(f"JSON: {args.json}")
    return 0 if all(r.passed for r in results.values()) else 1


def format_bisect_table(result, header: str) -> str:
    lines = [header]
    first = result.first
    if first is None:
        lines.append(
            f"no difference: all {len(result.ops)} compared ops are bitwise equal "
            f"({result.tokens} tokens, {result.target_tokens} scored)"
        )
    else:
        lines.append(
            f"first differing op: {first.name}  max |Δ| {first.max_abs_diff:.3g}, "
            f"{100 * first.equal_fraction:.1f}% of {first.numel} values equal"
        )
    lines.append("")
    width = max(len(op.name) for op in result.ops) if result.ops else 10
    lines.append(f"{'op'.ljust(width)}  bitwise  max |Δ|    equal")
    shown_after = 0
    past_first = False
    for op in result.ops:
        if past_first:
            if shown_after == OPS_SHOWN_AFTER_FIRST:
                rest = sum(1 for o in result.ops if not o.equal) - 1 - shown_after
                lines.append(f"... {len(result.ops) - result.ops.index(op)} more ops ({max(rest, 0)} more differ)")
                break
            shown_after += 1
        mark = "equal" if op.equal else "DIFF"
        lines.append(
            f"{op.name.ljust(width)}  {mark:7s}  {op.max_abs_diff:<9.3g}  {100 * op.equal_fraction:.1f}%"
            + (f"  {op.shape_mismatch}" if op.shape_mismatch else "")
        )
        if op.name == result.first_differing_op:
            past_first = True
    if result.not_compared:
        lines.append(f"not compared (exposed by one side only): {', '.join(result.not_compared)}")
    return "\n".join(lines)


def bisect_command(args) -> int:
    from .bisect import bisect_input, run_bisect
    from .engine_modules import EngineModules

    try:
        if args.num_prompts < 1 or args.max_tokens < 1:
            raise ValueError("--num-prompts and --max-tokens must be at least 1")
        mode = apply_numerics(args.numerics)
        max_model_len = resolve_max_model_len(args.model, args.max_model_len)
        prompts = eng.load_prompts(args.model, args.prompts, args.num_prompts)
        backend = load_backend(args.trainer, args.model, max_model_len=max_model_len, seed=args.seed)
    except (BackendUnavailable, ValueError, OSError) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    progress = _progress(2, args.quiet)
    try:
        progress.set_description("vLLM modules")
        with EngineModules(args.model, max_model_len=max_model_len, seed=args.seed) as modules:
            progress.update(1)
            progress.set_description("forward, both sides")
            vocab = modules.runtime.hf_config.vocab_size
            batch = bisect_input(prompts, args.max_tokens, vocab, seed=args.seed)
            result = run_bisect(modules, backend, batch)
            progress.update(1)
    finally:
        progress.close()
    header = f"zmrl bisect: {args.model} | vLLM modules vs trainer {args.trainer} | numerics {mode}"
    if args.json != "-":
        print(format_bisect_table(result, header))
    if args.json:
        try:
            _write_json(args.json, result.as_dict())
        except OSError as error:
            print(f"ERROR: cannot write {args.json}: {error}", file=sys.stderr)
            return 2
        if args.json != "-":
            print(f"JSON: {args.json}")
    return 0 if result.first_differing_op is None else 1
