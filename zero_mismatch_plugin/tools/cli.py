"""zmrl: the command line of zero_mismatch_plugin."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Callable


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the command is so that its cleanup (``with`` and ``finally``
    blocks: the engine's shutdown, the output lock) runs as it does for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class InterruptNote:
    """What a command has kept so far, for the one line it prints when it is interrupted."""

    def __init__(self, kept: str = "nothing was written"):
        self.kept = kept

    def keep(self, kept: str) -> None:
        self.kept = kept


def _stop_on_signal(signum, frame):
    # The first signal stops the command; further ones are ignored so that its cleanup (the engine's
    # shutdown, bounded in time) is not cut short. SIGKILL still ends everything.
    for other in (signal.SIGINT, signal.SIGTERM):
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


def run_interruptible(command: str, body: Callable[[InterruptNote], int], kept: str = "nothing was written") -> int:
    """Run ``body(note)``; on SIGINT or SIGTERM, let its cleanup run, print one line saying what was
    kept (``kept``, or what ``body`` told ``note`` since) and return 128 + the signal's number, as a
    shell reports a signalled command.

    The handlers are installed only on the main thread (the only one that receives signals) and
    restored afterwards.
    """
    note = InterruptNote(kept)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, _stop_on_signal)
    try:
        return body(note)
    except KeyboardInterrupt as stop:
        signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
        print(f"zmrl {command}: stopped by {signal.Signals(signum).name}; {note.kept}", file=sys.stderr, flush=True)
        return 128 + int(signum)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _validate_config(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.config_checks import check_config, format_report
    from zero_mismatch_plugin.tools.recipes import with_unaligned_trainer
    from zero_mismatch_plugin.tools.config_checks.validate_config import compose_verl_config

    overrides = with_unaligned_trainer(args.overrides, args.allow_unaligned_trainer)
    try:
        cfg = compose_verl_config(args.config_path, args.config_name, overrides)
    except Exception as error:  # noqa: BLE001 - composition errors are the user's to fix
        print(f"ERROR: cannot compose {args.config_name!r} from {args.config_path}: {error}", file=sys.stderr)
        return 2
    # The same checks `zmrl recipes run` applies before launching; errors go to stderr.
    problems = check_config(cfg)
    failed = any(p.fatal for p in problems)
    print(format_report(problems), file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


def _selfcheck(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.selfcheck import run_selfcheck

    return run_selfcheck()


def _report(args: argparse.Namespace) -> int:
    import json

    from zero_mismatch_plugin.tools.report import MetricLogError, build_report, load_runs
    from zero_mismatch_plugin.tools.report.render import format_report

    if args.window < 1:
        print(f"ERROR: --window must be at least 1, got {args.window}", file=sys.stderr)
        return 2
    try:
        runs = load_runs(args.runs)
    except MetricLogError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    report = build_report(runs, args.window)
    try:
        if args.json == "-":
            print(json.dumps(report, indent=2))
        else:
            print(format_report(report))
            if args.json:
                with open(args.json, "w", encoding="utf-8") as handle:
                    json.dump(report, handle, indent=2)
                print(f"\nJSON report: {args.json}")
        if args.plots:
            from zero_mismatch_plugin.tools.report.plots import write_plots

            # With JSON on stdout, the list of plots goes to stderr so stdout stays parseable.
            stream = sys.stderr if args.json == "-" else sys.stdout
            for name, path in write_plots(runs, args.plots).items():
                print(f"plot {name}: {path if path else 'not drawn, no run logged this quantity'}", file=stream)
    except OSError as error:
        print(f"ERROR: cannot write the report: {error}", file=sys.stderr)
        return 2
    return 0


def _recipes_list(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.recipes import RECIPES_DIR, list_recipes, recipe_alignment

    print(f"recipes in {RECIPES_DIR} (also --config-path=pkg://zero_mismatch_plugin.tools.recipes):")
    for info in list_recipes():
        # Composed and checked, not read from the comment: what the checks would say at launch.
        print(f"  {info.name}\n      {info.summary}\n      trainer: {recipe_alignment(info.name).describe()}")
    return 0


def _recipes_show(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.recipes import RecipeError, show_recipe

    try:
        print(show_recipe(args.name, args.overrides), end="")
    except RecipeError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    return 0


def _recipes_run(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.recipes import run_recipe

    return run_recipe(args.name, args.overrides, dry_run=args.dry_run,
                      allow_unaligned_trainer=args.allow_unaligned_trainer)


def _check(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.checker.commands import check_command

    return run_interruptible("check", lambda note: check_command(args),
                             kept="nothing was written (the table and --json come after the last check)")


def _bisect(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.checker.commands import bisect_command

    return bisect_command(args)


def _demo(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin.tools.demo.command import run_compare_command, run_demo_command

    if args.compare:
        single_run = [f"--{name}" for name in ("algo", "kernels", "seed") if getattr(args, name) is not None]
        if single_run:
            print(f"ERROR: {', '.join(single_run)} choose a single run; --compare runs every variant "
                  "(use --seeds for the seeds)", file=sys.stderr)
            return 2
        if args.turns != 1:
            print("ERROR: --turns chooses a single run's conversations; --compare runs single-turn variants",
                  file=sys.stderr)
            return 2
        if args.model != "dense":
            print("ERROR: --model moe chooses a single run's model; --compare runs the dense variants",
                  file=sys.stderr)
            return 2
        if args.lora is not None:
            print("ERROR: --lora chooses a single LoRA run; --compare runs full-weight variants", file=sys.stderr)
            return 2
        return run_interruptible("demo --compare", lambda note: run_compare_command(
            args.seeds, args.updates, args.lag, args.out, note=note, dtype=_demo_dtype(args.dtype),
            learning_rate=args.learning_rate, fixed_lag=args.fixed_lag))
    if args.seeds is not None:
        print("ERROR: --seeds is for --compare; a single run takes --seed", file=sys.stderr)
        return 2
    return run_interruptible("demo", lambda note: run_demo_command(
        args.algo or "reinforce_zero", args.kernels or "aligned", 2 if args.lag is None else args.lag,
        200 if args.updates is None else args.updates, args.seed or 0, args.out, args.turns, args.model, args.lora,
        note=note, dtype=_demo_dtype(args.dtype), learning_rate=args.learning_rate, fixed_lag=args.fixed_lag))


def _demo_dtype(flag: str) -> str:
    from zero_mismatch_plugin.tools.demo.learners import DTYPE_FLAGS

    return DTYPE_FLAGS[flag]


def _seed_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _patches(args: argparse.Namespace) -> int:
    from zero_mismatch_plugin import fork_patches

    if args.patches_command == "list":
        from zero_mismatch_plugin.integrations import patches as runtime_patches

        status = fork_patches.list_command()
        print()
        return status or runtime_patches.list_command()
    if args.patches_command == "check":
        return fork_patches.check_command(args.to, args.upstream)
    return fork_patches.apply_command(args.to, args.upstream, args.assume_version)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zmrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate-config", help="compose a verl config and check the plugin's requirements")
    validate.add_argument("--config-path", required=True, help="directory holding the Hydra config")
    validate.add_argument("--config-name", required=True, help="config file name without .yaml")
    validate.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. actor_rollout_ref.rollout.n=1")
    validate.set_defaults(func=_validate_config)

    selfcheck = sub.add_parser("selfcheck", help="check, on CPU, that verl sees the plugin and its losses work")
    selfcheck.set_defaults(func=_selfcheck)

    report = sub.add_parser(
        "report", help="run diagnostics (D3 peak/median, KL drift, rejection, lag) from verl metric logs"
    )
    report.add_argument(
        "runs", nargs="+", metavar="RUN", help="metric log (verl file logger or plain JSONL), or LABEL=PATH"
    )
    report.add_argument(
        "--window", type=int, default=1000, metavar="N", help="updates in the first/last windows (default 1000)"
    )
    report.add_argument(
        "--json", metavar="OUT", help="also write the report as JSON to OUT ('-': JSON on stdout instead of the table)"
    )
    report.add_argument("--plots", metavar="DIR", help="write PNG plots to DIR")
    report.set_defaults(func=_report)

    recipes = sub.add_parser("recipes", help="the shipped Hydra recipes: list, show the composed config, run")
    recipes_sub = recipes.add_subparsers(dest="recipes_command", required=True)
    recipes_list = recipes_sub.add_parser("list", help="every recipe with one line on what it runs")
    recipes_list.set_defaults(func=_recipes_list)
    recipes_show = recipes_sub.add_parser("show", help="print the fully composed config of a recipe")
    recipes_show.add_argument("name", help="recipe name (see `zmrl recipes list`)")
    recipes_show.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.nnodes=2")
    recipes_show.set_defaults(func=_recipes_show)
    recipes_run = recipes_sub.add_parser(
        "run", help="validate a recipe, then launch python -m verl.trainer.main_ppo with it"
    )
    recipes_run.add_argument("name", help="recipe name (see `zmrl recipes list`)")
    recipes_run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. actor_rollout_ref.model.path=...")
    recipes_run.add_argument("--dry-run", action="store_true", help="validate and print the exact command, do not run it")
    for command in (validate, recipes_run):
        command.add_argument(
            "--allow-unaligned-trainer", action="store_true",
            help="run a consistent-numerics config whose model/layout the aligned trainer forward does not cover, "
                 "with the trainer unaligned (adds the ZMRL_MEGATRON_ALIGNED='0' override; diff 0 cannot hold)",
        )
    recipes_run.set_defaults(func=_recipes_run)

    from zero_mismatch_plugin.tools.checker.registry import KNOWN_TRAINERS as trainers  # no torch import
    check = sub.add_parser(
        "check",
        help="run a vLLM engine and a trainer forward on the same weights; pass/fail per mismatch check",
    )
    bisect = sub.add_parser(
        "bisect", help="name the first op whose output differs between vLLM's modules and the trainer's"
    )
    for command in (check, bisect):
        command.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (HF format)")
        command.add_argument(
            "--trainer", choices=trainers, default="aligned", help="trainer forward to compare (default aligned)"
        )
        command.add_argument(
            "--prompts", metavar="FILE", help="prompts: text, one per line, or JSONL with prompt / prompt_token_ids"
        )
        command.add_argument(
            "--numerics",
            choices=("consistent", "fast"),
            help="ZMRL_NUMERICS for engine and trainer (default: the environment's, else consistent)",
        )
        command.add_argument(
            "--max-model-len", type=int, metavar="N", help="engine max_model_len (default min(2048, model max))"
        )
        command.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
        command.add_argument(
            "--dtype", choices=("float32", "bfloat16"), default="float32",
            help="the engine's dtype, which the trainer computes in too (default float32; the lm_head stays "
                 "fp32 in consistent mode)",
        )
        command.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT ('-': stdout only)")
        command.add_argument("--quiet", action="store_true", help="no progress bar")
        command.add_argument(
            "--lora",
            metavar="ADAPTER_DIR",
            help="PEFT LoRA adapter: the engine side serves it (enable_lora, the adapter's LoRARequest), "
            "the trainer is base + adapter. --trainer aligned: on the decoder linears, MLA projections, MoE "
            "experts and shared experts, embed_tokens / lm_head where vLLM adapts them; --trainer megatron: "
            "the decoder linears, MoE experts and shared experts",
        )
        # The trainer's layout (megatron's names). zmrl bisect compares each rank with vLLM's modules
        # in one process, so it takes every layout but tensor parallelism.
        command.add_argument(
            "--tensor-parallel", type=int, default=1, metavar="N",
            help="engine tensor_parallel_size N, and with --trainer megatron the Megatron face on N torchrun ranks "
                 "(megatron's tensor_model_parallel_size; default 1; zmrl check only)",
        )
        command.add_argument(
            "--sequence-parallel", action="store_true",
            help="with --tensor-parallel N > 1: megatron's sequence parallelism in the trainer",
        )
        command.add_argument(
            "--expert-parallel", type=int, default=1, metavar="N",
            help="with --trainer megatron on an MoE checkpoint: the Megatron face's experts on N torchrun ranks "
                 "(megatron's expert_model_parallel_size; the engine keeps its experts in one process; default 1)",
        )
        command.add_argument(
            "--moe-token-dispatcher", choices=("alltoall", "allgather"), default="alltoall",
            help="with --expert-parallel N > 1: megatron's moe_token_dispatcher_type (default alltoall)",
        )
        command.add_argument(
            "--pipeline-parallel", type=int, default=1, metavar="N",
            help="with --trainer megatron: the Megatron face's layers in N pipeline stages on N torchrun ranks "
                 "(megatron's pipeline_model_parallel_size and schedule; default 1)",
        )
        command.add_argument(
            "--context-parallel", type=int, default=1, metavar="N",
            help="with --trainer megatron: each sequence's rows split over N torchrun ranks, keys and values "
                 "gathered (megatron's context_parallel_size; default 1)",
        )
    check.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts to sample (default 8)")
    check.add_argument("--max-tokens", type=int, default=24, metavar="N", help="tokens per completion (default 24)")
    check.add_argument(
        "--batch-sizes", default="1,2,8", metavar="B,..", help="batch sizes for the batch-composition check"
    )
    check.add_argument(
        "--full-vocab", action="store_true", help="compare all vocabulary logprobs (default: the engine's top-20)"
    )
    check.add_argument(
        "--prefix-caching", choices=("on", "off"), default="on",
        help="engine prefix caching (default on: the prefix-cache check compares a hit with a miss and the "
             "trainer on the hit; off: the engine runs without it and that check is skipped)",
    )
    check.set_defaults(func=_check)
    bisect.add_argument("--num-prompts", type=int, default=4, metavar="N", help="sequences in the input (default 4)")
    bisect.add_argument(
        "--max-tokens", type=int, default=16, metavar="N", help="teacher-forced response tokens each (default 16)"
    )
    bisect.set_defaults(func=_bisect)

    demo = sub.add_parser(
        "demo", help="asynchronous RL with zero mismatch, end to end on a CPU (tiny model, vLLM, verl's losses)"
    )
    demo.add_argument("--algo", choices=("reinforce_zero", "flash_reinforce"), help="default reinforce_zero")
    demo.add_argument(
        "--kernels", choices=("aligned", "standard", "standard-bf16"),
        help="learner forward: vLLM's kernels (aligned, the default), plain transformers in fp32 (standard) "
        "or in bf16 mixed precision as verl's FSDP engine trains (standard-bf16)",
    )
    demo.add_argument("--lag", type=int, metavar="K",
                      help="samples are at most K versions old (0: synchronous; default 2, with --compare 8)")
    demo.add_argument("--fixed-lag", action="store_true",
                      help="samples are exactly K versions old (version u - K trains update u, once u >= K), "
                           "however fast the learner goes: every --compare variant sees the same lag")
    demo.add_argument("--updates", type=int, metavar="N",
                      help="optimizer updates per run (default 200, with --compare 300)")
    demo.add_argument("--seed", type=int, metavar="S", help="default 0")
    demo.add_argument(
        "--compare", action="store_true",
        help="the papers' contrast: aligned REINFORCE Zero, bf16 standard-kernel IS without / with verl's sequence "
        "and token gates, and synchronous aligned, on the class-chain task, for every seed of --seeds",
    )
    demo.add_argument("--seeds", type=_seed_list, metavar="S,..", help="with --compare (default 0,1,2)")
    demo.add_argument(
        "--turns", type=int, default=1, metavar="N",
        help="turns per conversation (default 1); each later turn re-sends the conversation with a new "
             "question, answered from the engine's prefix cache",
    )
    demo.add_argument(
        "--model", choices=("dense", "moe"), default="dense",
        help="the tiny model built locally: a dense Llama (default) or a Qwen3-MoE (8 experts, top-2)",
    )
    demo.add_argument(
        "--lora", type=int, metavar="R",
        help="freeze the base and train a rank-R LoRA adapter on every linear; the engine serves each new "
             "adapter version (vLLM's LoRA loading) after every update",
    )
    demo.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32",  # tools.demo.learners.DTYPE_FLAGS
        help="the engine's dtype (default fp32); bf16: the engine serves bf16 (fp32 head) in consistent mode and "
             "the aligned learner computes in it from fp32 master weights",
    )
    demo.add_argument("--learning-rate", type=float, default=1e-4, metavar="LR",
                      help="the learner's AdamW learning rate (default 1e-4; docs/compare.md's bf16 sets use 1e-5 and 3e-5)")
    demo.add_argument("--out", metavar="DIR", help="output directory (default: a fresh ./zmrl-demo-out[-N])")
    demo.set_defaults(func=_demo)

    patches = sub.add_parser("patches", help="upstream patches for a fork of verl / vLLM / Megatron-LM, and the runtime patches")
    patches_sub = patches.add_subparsers(dest="patches_command", required=True, metavar="{list,check,apply}")
    patches_sub.add_parser("list", help="every patch: fork patches (upstream, pinned version, purpose, covering test) "
                                              "and runtime patches (package, versions, target, when, why)")
    patches_check = patches_sub.add_parser(
        "check", help="apply every patch (patch -p1, git apply, git am -3) to copies of the installed upstream "
        "files; with --to DIR, report what each patch would do to that checkout (any version), changing nothing")
    patches_check.add_argument("--to", metavar="DIR", help="root of a verl / vLLM / Megatron-LM / mbridge checkout to report on")
    patches_check.add_argument("--upstream", choices=("verl", "vllm", "megatron-lm", "mbridge"), help="with --to; default: detected from DIR")
    patches_apply = patches_sub.add_parser("apply", help="apply the patches to a checkout of their upstream")
    patches_apply.add_argument("--to", required=True, metavar="DIR", help="root of the verl / vLLM / Megatron-LM / mbridge checkout")
    patches_apply.add_argument("--upstream", choices=("verl", "vllm", "megatron-lm", "mbridge"), help="default: detected from DIR")
    patches_apply.add_argument("--assume-version", metavar="V",
                               help="the checkout's version when its files state none (a fresh vLLM clone); "
                               "refused when the checkout states another version")
    patches.set_defaults(func=_patches)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, stray = parser.parse_known_args(argv)
    if stray:  # e.g. overrides after a flag: `zmrl recipes run NAME --dry-run key=value`
        from zero_mismatch_plugin.tools.recipes import StrayArguments, place_stray_arguments

        try:
            place_stray_arguments(parser, args, stray)
        except StrayArguments as error:
            parser.error(str(error))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
