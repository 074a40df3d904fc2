"""Command-line handlers of ``zmrl check`` and ``zmrl bisect`` (argument parsing is in ``cli``)."""

from __future__ import annotations

import json
import sys

from zero_mismatch_plugin.integrations.megatron.rank_group import RankFailure
from zero_mismatch_plugin.tools.checker import checkpoint_inputs
from zero_mismatch_plugin.tools.checker import engine as eng
from zero_mismatch_plugin.tools.checker import inputs
from zero_mismatch_plugin.tools.checker.backends import BackendUnavailable, load_backend
from zero_mismatch_plugin.tools.checker.checks import CHECK_NAMES, CheckOptions, count_steps, run_checks

# Ops listed after the first differing one in the bisect table (the rest are consequences).
OPS_SHOWN_AFTER_FIRST = 3


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise inputs.CheckerInputError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise inputs.CheckerInputError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def validated_inputs(args):
    """(max_model_len, prompt token ids, the checkpoint's blocks) once every input has been
    checked; nothing is started.

    The checkpoint as the chosen ``--trainer`` face builds it is checked here too
    (:func:`.checkpoint_inputs.precheck_model`, which returns the blocks), and last its weights are
    read once for NaN and infinities (:func:`.checkpoint_inputs.require_finite_weights`)."""
    inputs.require_at_least("--num-prompts", args.num_prompts)
    inputs.require_at_least("--max-tokens", args.max_tokens)
    inputs.require_seed(args.seed)
    config = checkpoint_inputs.read_checkpoint_config(args.model)
    max_model_len = inputs.resolve_max_model_len(config, args.max_model_len)
    inputs.require_json_destination(args.json)
    blocks = checkpoint_inputs.precheck_model(args.model, args.trainer)
    checkpoint_inputs.load_tokenizer(args.model)
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
    prompts = eng.load_prompts(args.model, args.prompts, args.num_prompts, vocab)
    inputs.require_prompts_fit(prompts, args.max_tokens, max_model_len)
    checkpoint_inputs.require_finite_weights(checkpoint_inputs.weight_files(args.model))
    return max_model_len, prompts, blocks


def apply_numerics(mode: str | None) -> str:
    """Select the numerics mode for both sides before anything vLLM starts (default consistent)."""
    from zero_mismatch_plugin.aligned.numerics import CONSISTENT, current_mode, set_mode

    mode = mode or current_mode() or CONSISTENT  # a bad ZMRL_NUMERICS is refused, naming what it takes
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


def lora_options(args) -> dict:
    """:func:`run_settings`' options for ``--lora ADAPTER_DIR``: the flag and the adapter's files
    checked before anything starts (whether the engine and the trainer face serve it is
    :func:`run_settings`' check)."""
    lora_dir = getattr(args, "lora", None)
    if lora_dir is None:
        return {}
    if args.trainer not in ("aligned", "megatron"):
        raise inputs.CheckerInputError(f"--lora is supported with --trainer aligned or megatron, not {args.trainer!r}")
    checkpoint_inputs.validate_adapter(lora_dir)
    return {"lora_dir": lora_dir}


def run_settings(args, max_model_len: int, lora: dict) -> eng.EngineSettings:
    """The run's :func:`.engine.engine_settings`; an adapter the engine or the ``--trainer`` face
    does not serve is refused here, naming what to change."""
    tensor_parallel = getattr(args, "tensor_parallel", 1)
    sequence_parallel = getattr(args, "sequence_parallel", False)
    if tensor_parallel < 1:
        raise inputs.CheckerInputError(f"--tensor-parallel {tensor_parallel}: give a number of ranks, 1 or more")
    if (tensor_parallel > 1 or sequence_parallel) and args.trainer != "megatron":
        raise inputs.CheckerInputError(
            f"--tensor-parallel / --sequence-parallel run the Megatron face on several ranks: use --trainer megatron "
            f"(--trainer {args.trainer} runs in one process)")
    if sequence_parallel and tensor_parallel == 1:
        raise inputs.CheckerInputError("--sequence-parallel splits tokens over tensor-parallel ranks: give --tensor-parallel 2 or more")
    expert_parallel = getattr(args, "expert_parallel", 1)
    if expert_parallel < 1:
        raise inputs.CheckerInputError(f"--expert-parallel {expert_parallel}: give a number of ranks, 1 or more")
    if expert_parallel > 1 and args.trainer != "megatron":
        raise inputs.CheckerInputError(
            f"--expert-parallel runs the Megatron face's experts on several ranks: use --trainer megatron "
            f"(--trainer {args.trainer} runs in one process)")
    if expert_parallel > 1 and tensor_parallel > 1 and expert_parallel != tensor_parallel:
        raise inputs.CheckerInputError(
            f"--expert-parallel {expert_parallel} with --tensor-parallel {tensor_parallel}: the checker runs the experts "
            "over the tensor-parallel ranks (expert tensor parallelism 1); give them the same size")
    pipeline_parallel = getattr(args, "pipeline_parallel", 1)
    context_parallel = getattr(args, "context_parallel", 1)
    for flag, size, what in (("--pipeline-parallel", pipeline_parallel, "the Megatron face's layers in stages"),
                             ("--context-parallel", context_parallel, "each sequence's rows split")):
        if size < 1:
            raise inputs.CheckerInputError(f"{flag} {size}: give a number of ranks, 1 or more")
        if size > 1 and args.trainer != "megatron":
            raise inputs.CheckerInputError(f"{flag} runs {what} on several ranks: use --trainer megatron "
                                           f"(--trainer {args.trainer} runs in one process)")
    try:
        settings = eng.engine_settings(
            args.model,
            max_model_len,
            seed=args.seed,
            full_vocab=getattr(args, "full_vocab", False),
            prefix_caching=getattr(args, "prefix_caching", "on") == "on",
            tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel,
            expert_parallel=expert_parallel,
            moe_token_dispatcher=getattr(args, "moe_token_dispatcher", "alltoall"),
            pipeline_parallel=pipeline_parallel,
            context_parallel=context_parallel,
            dtype=getattr(args, "dtype", "float32"),
            **lora,
        )
    except NotImplementedError as error:
        raise inputs.CheckerInputError(str(error)) from None
    if tensor_parallel > 1 and settings.blocks.moe is not None and not sequence_parallel:
        raise inputs.CheckerInputError(
            f"--tensor-parallel {tensor_parallel} on an MoE checkpoint: add --sequence-parallel (megatron runs MoE "
            "layers at tensor parallelism > 1 only with sequence parallelism)")
    if expert_parallel > 1 and settings.blocks.moe is None:
        raise inputs.CheckerInputError(f"--expert-parallel {expert_parallel}: {args.model} has no MoE layers; leave it at 1")
    if expert_parallel > 1 and settings.blocks.moe.num_experts % expert_parallel:
        raise inputs.CheckerInputError(f"--expert-parallel {expert_parallel} does not divide the checkpoint's "
                                       f"{settings.blocks.moe.num_experts} experts")
    if pipeline_parallel > 1:
        from zero_mismatch_plugin.aligned.checkpoint import read_config

        layers = read_config(args.model).num_hidden_layers
        if layers % pipeline_parallel:
            raise inputs.CheckerInputError(f"--pipeline-parallel {pipeline_parallel} does not divide the checkpoint's "
                                           f"{layers} layers (megatron splits them evenly over the stages)")
    if args.trainer == "megatron":
        _refuse_megatron_adapter(settings)
    return settings


def _refuse_megatron_adapter(settings: eng.EngineSettings) -> None:
    """The Megatron face adapts what the aligned face does (the targets ``served_adapter`` checked:
    decoder linears, routed and shared experts, embed_tokens / lm_head where the engine adapts them)
    except on multi-head latent attention models and an lm_head tied to the embedding; on ranks,
    what :func:`~zero_mismatch_plugin.faces.megatron.lora.layout_problem` allows."""
    blocks = settings.blocks
    mla = blocks.attention == "mla"
    refused = [t for t in settings.lora_targets if mla or (t == "lm_head" and blocks.tied_head)]
    if refused:
        why = "on a multi-head latent attention model" if mla else "with lm_head tied to embed_tokens"
        raise inputs.CheckerInputError(
            f"--trainer megatron serves LoRA on the decoder linears, MoE experts and embed_tokens / lm_head, but "
            f"not on multi-head latent attention models or a tied lm_head; this adapter targets {refused} {why}. "
            "Use --trainer aligned, which runs those adapters too."
        )
    if settings.lora_dir is None:
        return
    from zero_mismatch_plugin.faces.megatron.lora import layout_problem

    problem = layout_problem(settings.tensor_parallel, settings.sequence_parallel)
    if problem:
        raise inputs.CheckerInputError(f"--lora with --trainer megatron: {problem} (flags --tensor-parallel N "
                                       "--sequence-parallel)")


def check_command(args) -> int:
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
        max_model_len, prompts, _ = validated_inputs(args)
        lora = lora_options(args)
        settings = run_settings(args, max_model_len, lora)
        mode = apply_numerics(args.numerics)
        inputs.require_prompts_within_budget(prompts, eng.prefill_budget(settings))
        backend = load_backend(args.trainer, settings)
    except (BackendUnavailable, RankFailure, ValueError, OSError) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    options = CheckOptions(settings, num_prompts=args.num_prompts, max_tokens=args.max_tokens, batch_sizes=batch_sizes)
    try:
        with eng.open_engine(settings) as llm:
            progress = _progress(count_steps(options, len(prompts)), args.quiet)
            try:
                results, skipped = run_checks(llm, backend, prompts, options, progress)
            finally:
                progress.close()
    except RankFailure as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    finally:
        getattr(backend, "close", lambda: None)()  # a backend on torchrun ranks stops them
    header = (
        f"zmrl check: {args.model}"
        + (f" + LoRA {lora['lora_dir']}" if lora else "")
        + f" | trainer {args.trainer}{layout_words(settings)} | numerics {mode} | "
        f"{len(prompts)} prompts x {args.max_tokens} tokens, T=1 | prefix caching {args.prefix_caching}"
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


def layout_words(settings: eng.EngineSettings) -> str:
    """The trainer's layout for a table header ("" in one process)."""
    layout = f" | tensor parallel {settings.tensor_parallel}" if settings.tensor_parallel > 1 else ""
    layout += " + sequence parallel" if settings.sequence_parallel else ""
    if settings.expert_parallel > 1:
        layout += f" | expert parallel {settings.expert_parallel} ({settings.moe_token_dispatcher})"
    if settings.pipeline_parallel > 1:
        layout += f" | pipeline parallel {settings.pipeline_parallel}"
    if settings.context_parallel > 1:
        layout += f" | context parallel {settings.context_parallel}"
    return layout


def format_bisect_table(result, header: str) -> str:
    lines = [header]
    first = result.first
    if first is None:
        lines.append(
            f"no difference: all {len(result.ops)} compared ops are bitwise equal "
            f"({result.tokens} tokens, {result.target_tokens} scored)"
        )
    else:
        on = f" on rank {', '.join(map(str, first.differing_ranks))}" if first.differing_ranks else ""
        lines.append(f"first differing op: {first.name}{on}  {first.problem}")
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
        mark = "equal" if op.equal else ("NaN/inf" if op.non_finite else "DIFF")
        lines.append(
            f"{op.name.ljust(width)}  {mark:7s}  {op.max_abs_diff:<9.3g}  {100 * op.equal_fraction:.1f}%"
            + (f"  {op.shape_mismatch}" if op.shape_mismatch else "")
        )
        if op.name == result.first_differing_op:
            past_first = True
    if result.not_compared:
        lines.append(f"not compared (exposed by one side only): {', '.join(result.not_compared)}")
    return "\n".join(lines)


def _refuse_mla_bisect(model_dir, blocks) -> None:
    """vLLM's MLA attention splits a batch into prefill and decode steps from the engine's
    scheduler metadata, which vLLM's modules run outside the engine do not have (linear-attention
    layers get theirs: every sequence prefilled from a fresh state slot)."""
    if blocks.attention == "mla":
        raise inputs.CheckerInputError(
            f"{model_dir}: zmrl bisect does not run multi-head latent attention (DeepSeek-V2/V3) models yet; "
            "use zmrl check, which compares the trainer with a live engine on them (with --lora too)"
        )


def bisect_command(args) -> int:
    from zero_mismatch_plugin.tools.checker.bisect import bisect_input, run_bisect
    from zero_mismatch_plugin.tools.checker.engine_modules import EngineModules

    try:
        max_model_len, prompts, blocks = validated_inputs(args)
        _refuse_mla_bisect(args.model, blocks)
        lora = lora_options(args)
        settings = run_settings(args, max_model_len, lora)
        mode = apply_numerics(args.numerics)
        backend = load_backend(args.trainer, settings)
    except (BackendUnavailable, RankFailure, ValueError, OSError) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    progress = _progress(2, args.quiet)
    try:
        progress.set_description("vLLM modules")
        with EngineModules(settings) as modules:
            progress.update(1)
            progress.set_description("forward, both sides")
            vocab = modules.runtime.hf_config.vocab_size
            batch = bisect_input(prompts, args.max_tokens, vocab, seed=args.seed)
            result = run_bisect(modules, backend, batch)
            progress.update(1)
    except RankFailure as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    finally:
        progress.close()
        getattr(backend, "close", lambda: None)()  # a backend on torchrun ranks stops them
    header = (
        f"zmrl bisect: {args.model}" + (f" + LoRA {lora['lora_dir']}" if lora else "")
        + f" | vLLM modules vs trainer {args.trainer}{layout_words(settings)} | numerics {mode}"
    )
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
