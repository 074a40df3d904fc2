"""The shipped Hydra recipes and ``zmrl recipes list | show | run``.

Each top-level ``*.yaml`` here is a recipe composed on verl's ``ppo_trainer``; the ``zm_*``
directories are the groups they share. :func:`validate_recipe` applies the config checks
(:mod:`zero_mismatch_plugin.tools.config_checks`), :func:`run_recipe` then launches verl with this
directory as an absolute ``--config-path``. See docs/recipes.md.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf

from zero_mismatch_plugin.tools.config_checks import Problem, check_config, checked, format_report, run_checks
from zero_mismatch_plugin.tools.config_checks.alignment import UNALIGNED_OVERRIDE, TrainerAlignment, trainer_alignment
from zero_mismatch_plugin.tools.config_checks.cluster import (
    PolicyLag,
    RolloutLayout,
    TrainerLayout,
    cluster_gpus,
    lora_rank,
    policy_lag,
    rollout_layout,
    trainer_layout,
    uses_separate_rollout_pool,
)
from zero_mismatch_plugin.tools.config_checks.numerics import is_consistent, runtime_env_vars
from zero_mismatch_plugin.tools.config_checks.values import ENV_VARS_KEY, ConfigValueError, read
from zero_mismatch_plugin.tools.config_checks.validate_config import compose_verl_config

__all__ = [
    "CONFIG_MODULE", "ENV_VARS_KEY", "RECIPES_DIR", "PolicyLag", "RecipeError", "RecipeInfo", "RolloutLayout",
    "StrayArguments", "TrainerLayout", "check_recipe", "cluster_gpus", "compose_recipe", "is_consistent", "launch_command",
    "list_recipes", "lora_rank", "place_stray_arguments", "policy_lag", "recipe_alignment", "recipe_info", "recipe_names",
    "recipe_path", "recipe_problems", "rollout_layout", "run_recipe", "runtime_env_vars", "show_recipe",
    "trainer_layout", "uses_separate_rollout_pool", "validate_recipe", "with_unaligned_trainer",
]

RECIPES_DIR = Path(__file__).resolve().parent
CONFIG_MODULE = "pkg://zero_mismatch_plugin.tools.recipes"
LAUNCHER_MODULE = "verl.trainer.main_ppo"
SEED_PREFIX = "# Seed:"
TRAINER_PREFIX = "# Trainer:"


class RecipeError(Exception):
    """A recipe that does not exist or does not compose."""


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    summary: str
    seed_result: str
    trainer: str  # the header's "# Trainer:" line: what the recipe says about its trainer side


# ----- listing and composing ---------------------------------------------------------------


def recipe_names() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    # Only the top-level files are recipes: a group file or a path is not, whatever exists there.
    names = recipe_names()
    if name not in names:
        import difflib

        stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
        close = difflib.get_close_matches(stem, names, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(match) for match in close)}? " if close else ""
        raise RecipeError(f"no recipe named {name!r}; {hint}available: {', '.join(names)}")
    return RECIPES_DIR / f"{name}.yaml"


def _header_line(comments: list[str], prefix: str) -> str:
    return next((line[len(prefix):].strip() for line in comments if line.startswith(prefix)), "")


def recipe_info(name: str) -> RecipeInfo:
    """The first comment line (what the recipe is), its ``# Seed:`` line (what was reported) and
    its ``# Trainer:`` line (whether the trainer side is aligned)."""
    lines = recipe_path(name).read_text(encoding="utf-8").splitlines()
    comments = [line for line in lines if line.startswith("#")]
    summary = comments[0].lstrip("# ").strip() if comments else ""
    return RecipeInfo(name=name, summary=summary, seed_result=_header_line(comments, SEED_PREFIX),
                      trainer=_header_line(comments, TRAINER_PREFIX))


def list_recipes() -> list[RecipeInfo]:
    return [recipe_info(name) for name in recipe_names()]


def compose_recipe(name: str, overrides: Iterable[str] = ()) -> DictConfig:
    recipe_path(name)
    try:
        return compose_verl_config(RECIPES_DIR, name, list(overrides))
    except Exception as error:  # noqa: BLE001 - Hydra raises several types; all are the user's to fix
        raise RecipeError(f"cannot compose recipe {name!r}: {error}") from error


def show_recipe(name: str, overrides: Iterable[str] = ()) -> str:
    """The fully composed config as YAML, interpolations resolved where they can be."""
    cfg = compose_recipe(name, overrides)
    try:
        return OmegaConf.to_yaml(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - e.g. a mandatory value left unset: show it unresolved
        return OmegaConf.to_yaml(cfg)


def recipe_alignment(name: str) -> TrainerAlignment:
    """Whether the recipe's trainer side is aligned today, as composed (see ``config_checks.alignment``)."""
    return trainer_alignment(compose_recipe(name))


# ----- checks ---------------------------------------------------------------------------------


def recipe_problems(cfg: DictConfig) -> list[Problem]:
    """What verl would reject only at start-up on the cluster, what parity needs, and whether the
    trainer side is aligned."""
    return checked(cfg, *run_checks())


def check_recipe(cfg: DictConfig) -> list[Problem]:
    """``zmrl validate-config``'s checks: the algorithms' requirements plus :func:`recipe_problems`."""
    return check_config(cfg)


# ----- the command line ---------------------------------------------------------------------------


class StrayArguments(ValueError):
    """Arguments ``zmrl`` cannot place; the message says where they go."""


def _subcommands(parser) -> dict[str, object]:
    """``{"validate-config": parser, "recipes run": parser, ...}`` for every (nested) subcommand."""
    import argparse

    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {inner}": nested for inner, nested in _subcommands(sub).items()})
    return found


def _options(parser) -> set[str]:
    return {option for option in parser._option_string_actions if option.startswith("--")} - {"--help"}


def place_stray_arguments(parser, args, stray: Sequence[str]) -> None:
    """Put the arguments argparse left over into ``args.overrides``, or say where they belong.

    argparse takes a command's overrides only before its first flag, so ``zmrl recipes run NAME
    --dry-run key=value`` leaves ``key=value`` over: Hydra overrides (no leading ``-``) are taken
    wherever they stand, in their order. A flag is refused, naming the command it belongs to or the
    one it is close to."""
    import difflib

    command = args.command if getattr(args, "recipes_command", None) is None else f"{args.command} {args.recipes_command}"
    subcommands = _subcommands(parser)
    flags = [argument for argument in stray if argument.startswith("-")]
    if not flags and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *stray]
        return
    if not flags:
        raise StrayArguments(f"unrecognized arguments: {' '.join(stray)} (`zmrl {command}` takes no overrides)")
    own = _options(subcommands[command]) if command in subcommands else set()
    advice = []
    for flag in flags:
        name = flag.split("=", 1)[0]
        elsewhere = [other for other, sub in subcommands.items() if other != command and name in _options(sub)]
        close = difflib.get_close_matches(name, sorted(own), n=1, cutoff=0.7)
        if close:
            advice.append(f"{flag}: did you mean {close[0]}?")
        elif elsewhere:
            advice.append(f"{flag} is an option of {' and '.join(f'`zmrl {other}`' for other in elsewhere)}, "
                          f"not of `zmrl {command}`")
        else:
            advice.append(f"{flag} is not an option of `zmrl {command}`"
                          + (f" (its options: {', '.join(sorted(own))})" if own else ""))
    raise StrayArguments(f"unrecognized arguments: {' '.join(stray)} ({'; '.join(advice)})")


# ----- validating and launching -------------------------------------------------------------------


def with_unaligned_trainer(overrides: Sequence[str], allow_unaligned_trainer: bool) -> list[str]:
    """The overrides, plus the one that turns the aligned trainer forward off when allowed."""
    return [*overrides, UNALIGNED_OVERRIDE] if allow_unaligned_trainer else list(overrides)


def launch_command(name: str, overrides: Sequence[str] = (), python: str | None = None,
                   platform: str | None = None) -> list[str]:
    """``python -m verl.trainer.main_ppo --config-path=<this directory> --config-name=NAME overrides...``

    The recipe's environment (the consistent switch, the aligned trainer forward, ROCm GEMM
    routing) is part of the config (``ray_kwargs.ray_init.runtime_env.env_vars``), which verl hands
    to every Ray worker. Only the device platform cannot come from the config: verl resolves it in
    the launching process before reading any config, so ``platform="cpu"`` (a recipe's
    ``zmrl.platform``) prefixes the command with ``env`` and the CPU platform's variables.
    """
    recipe_path(name)
    command = [python or sys.executable, "-m", LAUNCHER_MODULE, f"--config-path={RECIPES_DIR}",
               f"--config-name={name}", *overrides]
    if platform == "cpu":
        from zero_mismatch_plugin.integrations.verl.cpu.launch import env_command_prefix

        command = [*env_command_prefix(), *command]
    return command


SMOKE_INPUT_KEYS = ("actor_rollout_ref.model.path", "data.train_files")


def _with_smoke_inputs(overrides: Sequence[str], inputs_dir: Path, build: bool = True) -> list[str]:
    """A CPU recipe run without a model or data set gets the tiny local ones (built once in
    ``inputs_dir``; ``build=False``: only pointed at, for a dry run); paths the user gave are kept.
    (The recipe cannot mark them ``???``: a merged ``???`` never replaces verl's default paths.)"""
    given = {override.split("=", 1)[0].lstrip("+") for override in overrides}
    if all(key in given for key in SMOKE_INPUT_KEYS):
        return list(overrides)
    from zero_mismatch_plugin.integrations.verl.cpu.launch import input_overrides
    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_inputs, smoke_input_overrides

    inputs = build_smoke_inputs(inputs_dir) if build else smoke_input_overrides(inputs_dir)
    return [*input_overrides({key: path for key, path in inputs.items() if key not in given}), *overrides]


def validate_recipe(name: str, overrides: Sequence[str] = (),
                    err: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> int:
    """Compose and check a recipe; print the problems. 0: launchable, 1: a fatal problem, 2: no such
    recipe or it does not compose. Starts nothing."""
    try:
        cfg = compose_recipe(name, overrides)
    except RecipeError as error:
        err(f"ERROR: {error}")
        return 2
    return _report_problems(name, cfg, err)


def _report_problems(name: str, cfg: DictConfig, err: Callable[[str], None]) -> int:
    """:func:`validate_recipe` on a composed config: 1 on a fatal problem, else 0."""
    problems = check_recipe(cfg)
    if any(problem.fatal for problem in problems):
        err(format_report(problems))
        err(f"refusing to launch {name!r}: fix the errors above")
        return 1
    for problem in problems:
        err(str(problem))
    return 0


# Where `zmrl recipes run` builds the tiny model and data set of a CPU recipe run without them
# (relative to the working directory), unless the recipe's zmrl.smoke_inputs names another folder.
SMOKE_INPUTS_DIR = "zmrl-cpu-smoke-inputs"
SMOKE_INPUTS_KEY = "zmrl.smoke_inputs"
HYDRA_RUN_DIR_KEY = "hydra.run.dir"


def smoke_inputs_dir(cfg: DictConfig) -> Path:
    """Where a CPU recipe run builds its tiny model and data set: ``zmrl.smoke_inputs``, else
    ``./zmrl-cpu-smoke-inputs`` (a bad value is left to validation, which names it)."""
    try:
        chosen = read(cfg, SMOKE_INPUTS_KEY)
    except ConfigValueError:
        chosen = None
    return Path(chosen or SMOKE_INPUTS_DIR).expanduser().resolve()


def _cannot_write(folder: Path, create: bool) -> str | None:
    """Why ``folder`` cannot receive files (None: it can). ``create``: make it (it is about to be
    filled); otherwise only a file is created and removed in it."""
    import tempfile

    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return None


def _cpu_run_problems(inputs_dir: Path, overrides: Sequence[str], build: bool) -> list[str]:
    """What stops a CPU recipe run from writing what it writes, before anything is built or launched:
    the folder its inputs are built in, and the working directory, where verl's launcher (a Hydra
    app) creates its run directory unless ``hydra.run.dir`` moves it."""
    problems = []
    if build:
        why = _cannot_write(inputs_dir, create=True)
        if why:
            problems.append(f"the CPU run builds its tiny model and data set in {inputs_dir}, which cannot be "
                            f"written ({why}): move it with {SMOKE_INPUTS_KEY}=DIR, or give your own "
                            f"{' and '.join(f'{key}=...' for key in SMOKE_INPUT_KEYS)}")
    if not any(override.lstrip("+").startswith(f"{HYDRA_RUN_DIR_KEY}=") for override in overrides):
        cwd = Path.cwd()
        why = _cannot_write(cwd, create=False)
        if why:
            problems.append(f"verl's launcher writes its Hydra run directory (outputs/DATE/TIME) in the working "
                            f"directory {cwd}, which cannot be written ({why}): run from a writable directory, "
                            f"or move it with {HYDRA_RUN_DIR_KEY}=DIR")
    return problems


def recipe_platform(cfg: DictConfig) -> str | None:
    """The recipe's ``zmrl.platform`` (``None``: verl picks its device); a bad value is left to
    validation, which names it."""
    try:
        return read(cfg, "zmrl.platform")
    except ConfigValueError:
        return None


def _launch(command: list[str]) -> int:
    return subprocess.call(command)


def run_recipe(
    name: str,
    overrides: Sequence[str] = (),
    dry_run: bool = False,
    launcher: Callable[[list[str]], int] | None = None,
    out: Callable[[str], None] = print,
    err: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
    allow_unaligned_trainer: bool = False,
) -> int:
    """Validate (:func:`validate_recipe`), then launch verl's trainer (or print the command under ``dry_run``).

    Exit status: 2 if the recipe does not exist or compose, 1 if validation finds a fatal problem
    (the trainer is not started, also under ``dry_run``), 2 if a CPU run could not write its inputs or
    verl's Hydra run directory (checked before anything is built), else the launcher's status (0 for
    a dry run).
    ``allow_unaligned_trainer`` adds the override that runs the trainer without the aligned forward
    (a loud warning says diff 0 cannot hold).
    """
    overrides = with_unaligned_trainer(overrides, allow_unaligned_trainer)
    try:
        cfg = compose_recipe(name, overrides)
    except RecipeError:
        cfg = None  # validation says why it does not compose
    platform = None if cfg is None else recipe_platform(cfg)
    inputs_dir = None
    if platform == "cpu":
        # Validated with the paths a run builds the inputs at; built only after validation, and never for
        # a dry run (which prints the command with those paths).
        inputs_dir = smoke_inputs_dir(cfg)
        planned = _with_smoke_inputs(overrides, inputs_dir, build=False)
        build = not dry_run and planned != list(overrides)
    else:
        planned, build = list(overrides), False
    # Composing costs about a second (Hydra reads verl's whole config tree): validate the config
    # already composed when the run adds no input paths to it.
    if cfg is not None and planned == list(overrides):
        status = _report_problems(name, cfg, err)
    else:
        status = validate_recipe(name, planned, err)
    if status:
        return status
    if platform == "cpu" and not dry_run:
        problems = _cpu_run_problems(inputs_dir, overrides, build)
        if problems:
            for problem in problems:
                err(f"ERROR: {problem}")
            err(f"refusing to launch {name!r}: nothing was built or started")
            return 2
    if build:
        try:
            overrides = _with_smoke_inputs(overrides, inputs_dir, build=True)
        except OSError as error:
            err(f"ERROR: cannot build the CPU run's inputs in {inputs_dir}: {error}; move them with "
                f"{SMOKE_INPUTS_KEY}=DIR")
            return 2
    else:
        overrides = planned
    command = launch_command(name, overrides, platform=platform)
    if dry_run:
        out(shlex.join(command))
        return 0
    return int((launcher or _launch)(command))
