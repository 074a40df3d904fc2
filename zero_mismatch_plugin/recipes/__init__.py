"""The shipped Hydra recipes and ``zmrl recipes list | show | run``.

Each top-level ``*.yaml`` in this directory is a recipe: a primary Hydra config composed on
verl's ``ppo_trainer`` (``hydra.searchpath: [pkg://verl.trainer.config]``). The ``zm_*``
sub-directories are the Hydra groups the recipes share (algorithm, async mode and lag,
numerics, engine, model, LoRA, task, experiment, run bookkeeping).

verl's launcher resolves a relative ``--config-path`` against its own package directory, so the
command this module builds passes this directory as an absolute path. From any shell the same
recipes are reachable as ``--config-path=pkg://zero_mismatch_plugin.recipes``.

Besides the plugin's own requirements (:func:`zero_mismatch_plugin.validate_config.validate_config`),
:func:`recipe_problems` checks what verl only finds out on a cluster: the parallel layout against
the GPU count, batch divisibility, the separate-async trainer's preconditions, the static-CP
normalization caveat, and what exact logprob parity needs when the consistent switch is on.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf

from zero_mismatch_plugin.validate_config import Problem, compose_verl_config, validate_config

RECIPES_DIR = Path(__file__).resolve().parent
CONFIG_MODULE = "pkg://zero_mismatch_plugin.recipes"
LAUNCHER_MODULE = "verl.trainer.main_ppo"

ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
NUMERICS_ENV = "ZMRL_NUMERICS"
CONSISTENT = "consistent"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
ALLOW_PREFIX_CACHING_ENV = "ZMRL_ALLOW_PREFIX_CACHING"
SEED_PREFIX = "# Seed:"


class RecipeError(Exception):
    """A recipe that does not exist or does not compose."""


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    summary: str
    seed_result: str


@dataclass(frozen=True)
class TrainerLayout:
    """The training engine's parallel layout over ``world`` GPUs (Megatron naming)."""

    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    expert_dp: int

    def dense_product(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def expert_product(self) -> int:
        return self.etp * self.ep * self.pp * self.expert_dp


@dataclass(frozen=True)
class RolloutLayout:
    """The rollout engine's replicas over ``world`` GPUs (vLLM: a replica spans TP x DP x PP GPUs)."""

    world: int
    tp: int
    dp: int
    pp: int
    ep: int
    replica_size: int
    replicas: int


@dataclass(frozen=True)
class PolicyLag:
    """How stale a trained sample can be.

    ``max_versions``: weight versions between the sampling weights and the learner's (verl's
    staleness span minus one). ``max_updates``: the same in optimizer updates, which is how the
    papers count lag. ``None`` means unbounded.
    """

    trainer_mode: str
    updates_per_step: int
    max_versions: int | None
    max_updates: int | None


# ----- listing and composing ---------------------------------------------------------------


def recipe_names() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise RecipeError(f"no recipe named {name!r}; available: {', '.join(recipe_names())}")
    return path


def recipe_info(name: str) -> RecipeInfo:
    """The first comment line (what the recipe is) and its ``# Seed:`` line (what was reported)."""
    lines = recipe_path(name).read_text(encoding="utf-8").splitlines()
    comments = [line for line in lines if line.startswith("#")]
    summary = comments[0].lstrip("# ").strip() if comments else ""
    seed = next((line[len(SEED_PREFIX):].strip() for line in comments if line.startswith(SEED_PREFIX)), "")
    return RecipeInfo(name=name, summary=summary, seed_result=seed)


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


# ----- derived quantities --------------------------------------------------------------------


def _get(cfg: DictConfig, key: str, default=None):
    value = OmegaConf.select(cfg, key, default=default)
    return default if value is None else value


def trainer_layout(cfg: DictConfig) -> TrainerLayout:
    """TP/PP/CP/EP/DP of the actor over ``trainer.nnodes x trainer.n_gpus_per_node`` GPUs.

    Megatron: dense DP = world / (TP x PP x CP); experts: expert DP = world / (ETP x EP x PP),
    ETP defaulting to TP. FSDP: every GPU is a data-parallel rank (Ulysses SP counted as CP).
    Integer division; :func:`recipe_problems` reports a layout that does not divide.
    """
    world = int(_get(cfg, "trainer.nnodes", 1)) * int(_get(cfg, "trainer.n_gpus_per_node", 1))
    actor = "actor_rollout_ref.actor"
    if _get(cfg, f"{actor}.strategy") == "megatron":
        mcore = f"{actor}.megatron"
        tp = int(_get(cfg, f"{mcore}.tensor_model_parallel_size", 1))
        pp = int(_get(cfg, f"{mcore}.pipeline_model_parallel_size", 1))
        cp = int(_get(cfg, f"{mcore}.context_parallel_size", 1))
        ep = int(_get(cfg, f"{mcore}.expert_model_parallel_size", 1))
        etp = int(_get(cfg, f"{mcore}.expert_tensor_parallel_size", tp))
    else:
        tp = pp = ep = etp = 1
        cp = int(_get(cfg, f"{actor}.ulysses_sequence_parallel_size", 1))
    return TrainerLayout(world=world, tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp), ep=ep, etp=etp,
                         expert_dp=world // (etp * ep * pp))


def uses_separate_rollout_pool(cfg: DictConfig) -> bool:
    return _get(cfg, "trainer.v1.trainer_mode") == "separate_async" and not _get(
        cfg, "actor_rollout_ref.hybrid_engine", True)


def rollout_layout(cfg: DictConfig) -> RolloutLayout:
    """vLLM replicas: each spans TP x DP x PP GPUs; they share the training GPUs when colocated,
    or the ``rollout.nnodes x rollout.n_gpus_per_node`` pool in separate-async mode."""
    rollout = "actor_rollout_ref.rollout"
    if uses_separate_rollout_pool(cfg):
        world = int(_get(cfg, f"{rollout}.nnodes", 0)) * int(_get(cfg, f"{rollout}.n_gpus_per_node", 0))
    else:
        world = trainer_layout(cfg).world
    tp = int(_get(cfg, f"{rollout}.tensor_model_parallel_size", 1))
    dp = int(_get(cfg, f"{rollout}.data_parallel_size", 1))
    pp = int(_get(cfg, f"{rollout}.pipeline_model_parallel_size", 1))
    ep = int(_get(cfg, f"{rollout}.expert_parallel_size", 1))
    size = tp * dp * pp
    return RolloutLayout(world=world, tp=tp, dp=dp, pp=pp, ep=ep, replica_size=size, replicas=world // size)


def cluster_gpus(cfg: DictConfig) -> int:
    """All GPUs the recipe occupies: the training GPUs, plus the rollout pool when separate."""
    extra = rollout_layout(cfg).world if uses_separate_rollout_pool(cfg) else 0
    return trainer_layout(cfg).world + extra


def policy_lag(cfg: DictConfig) -> PolicyLag:
    """The maximum policy lag a recipe allows, from verl's trainer mode and staleness bound.

    verl counts a trajectory's span inclusively: sampled and trained at the same version is a
    span of 1, so ``max_off_policy_threshold = T`` bounds the lag at ``T - 1`` versions. Weights
    are synced once per trainer step, which holds ``U`` optimizer updates (ppo_epochs x
    mini-batches); a sample is at most ``U * T - 1`` updates old. In ``sync`` mode samples come
    from the weights of the step that trains on them (0 versions).
    """
    mode = str(_get(cfg, "trainer.v1.trainer_mode", "sync"))
    train = int(_get(cfg, "data.train_batch_size"))
    mini = int(_get(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size"))
    epochs = int(_get(cfg, "actor_rollout_ref.actor.ppo_epochs", 1))
    updates = epochs * max(train // mini, 1)
    if mode == "sync":
        return PolicyLag(mode, updates, 0, updates - 1)
    threshold = OmegaConf.select(cfg, "trainer.v1.sampler.max_off_policy_threshold")
    if threshold is None:
        return PolicyLag(mode, updates, None, None)
    return PolicyLag(mode, updates, int(threshold) - 1, updates * int(threshold) - 1)


def runtime_env_vars(cfg: DictConfig) -> dict[str, str]:
    env = OmegaConf.select(cfg, ENV_VARS_KEY)
    return {} if env is None else {str(k): str(v) for k, v in OmegaConf.to_container(env).items()}


def is_consistent(cfg: DictConfig) -> bool:
    return runtime_env_vars(cfg).get(NUMERICS_ENV) == CONSISTENT


def lora_rank(cfg: DictConfig) -> int:
    rank = int(_get(cfg, "actor_rollout_ref.model.lora.rank", 0))
    return rank if rank > 0 else int(_get(cfg, "actor_rollout_ref.model.lora_rank", 0))


# ----- checks ---------------------------------------------------------------------------------


def recipe_problems(cfg: DictConfig) -> list[Problem]:
    """What verl would reject only at start-up on the cluster, and what parity needs."""
    problems: list[Problem] = []

    def add(key: str, message: str, fatal: bool = True) -> None:
        problems.append(Problem(key, message, fatal))

    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    mode = str(_get(cfg, "trainer.v1.trainer_mode", "sync"))

    # Trainer layout.
    layout = trainer_layout(cfg)
    if layout.world < 1:
        add("trainer.nnodes", f"no training GPUs (trainer.nnodes x trainer.n_gpus_per_node = {layout.world})")
        return problems
    if layout.world % (layout.tp * layout.pp * layout.cp):
        add(f"{actor}.megatron", f"{layout.world} training GPUs are not divisible by TP {layout.tp} x PP {layout.pp} "
                                 f"x CP {layout.cp}")
    if layout.world % (layout.etp * layout.ep * layout.pp):
        add(f"{actor}.megatron.expert_model_parallel_size",
            f"{layout.world} training GPUs are not divisible by expert TP {layout.etp} x EP {layout.ep} x PP {layout.pp}")

    # Rollout layout.
    roll = rollout_layout(cfg)
    if uses_separate_rollout_pool(cfg) and roll.world < 1:
        add(f"{rollout}.nnodes", "separate_async without colocated replicas needs a rollout pool "
                                 "(rollout.nnodes x rollout.n_gpus_per_node > 0)")
    elif roll.world % roll.replica_size:
        add(f"{rollout}.tensor_model_parallel_size",
            f"{roll.world} rollout GPUs are not a whole number of replicas of TP {roll.tp} x DP {roll.dp} x PP {roll.pp}")
    gpus_per_node = int(_get(cfg, f"{rollout}.n_gpus_per_node", 8))
    if roll.replica_size % min(gpus_per_node, roll.replica_size):
        add(f"{rollout}.tensor_model_parallel_size",
            f"a {roll.replica_size}-GPU replica does not fill whole {gpus_per_node}-GPU nodes")
    if roll.ep > 1 and roll.ep != roll.tp * roll.dp:
        add(f"{rollout}.expert_parallel_size", f"vLLM expert parallelism must equal TP x DP = {roll.tp * roll.dp}")
    if mode == "separate_async":
        if not uses_separate_rollout_pool(cfg) and int(_get(cfg, f"{rollout}.nnodes", 0)) < 1:
            add(f"{rollout}.nnodes", "separate_async needs a rollout pool (rollout.nnodes > 0)")
        if _get(cfg, f"{rollout}.checkpoint_engine.backend") == "naive":
            add(f"{rollout}.checkpoint_engine.backend", "separate_async needs a collective backend (nccl, nixl, ...)")
    elif not _get(cfg, "actor_rollout_ref.hybrid_engine", True):
        add("actor_rollout_ref.hybrid_engine", f"false is only supported with separate_async (now {mode})")

    # Batch sizes.
    train = int(_get(cfg, "data.train_batch_size"))
    mini = int(_get(cfg, f"{actor}.ppo_mini_batch_size"))
    n = int(_get(cfg, f"{rollout}.n", 1))
    if train % mini:
        add(f"{actor}.ppo_mini_batch_size", f"{mini} does not divide data.train_batch_size {train}")
    if (mini * n) % layout.dp:
        add(f"{actor}.ppo_mini_batch_size",
            f"{mini} prompts x n {n} = {mini * n} responses per update do not split over {layout.dp} data-parallel ranks")
    if mode == "separate_async":
        sync_step = int(_get(cfg, "trainer.v1.separate_async.parameter_sync_step", 1))
        if train != sync_step * mini:
            add(f"{actor}.ppo_mini_batch_size", f"separate_async needs train_batch_size {train} == "
                                                f"parameter_sync_step {sync_step} x ppo_mini_batch_size {mini}")
    if _get(cfg, f"{actor}.use_dynamic_bsz", False):
        longest = int(_get(cfg, "data.max_prompt_length")) + int(_get(cfg, "data.max_response_length"))
        budget = int(_get(cfg, f"{actor}.ppo_max_token_len_per_gpu")) * layout.cp
        if budget < longest:
            add(f"{actor}.ppo_max_token_len_per_gpu",
                f"a full trajectory ({longest} tokens) does not fit one micro-batch (token budget x CP = {budget})")

    # verl 0.9.1's Megatron engine mis-normalizes seq-mean-token-mean under static CP.
    if (_get(cfg, f"{actor}.strategy") == "megatron" and layout.cp > 1
            and _get(cfg, f"{actor}.loss_agg_mode") == "seq-mean-token-mean"
            and not _get(cfg, f"{actor}.megatron.dynamic_context_parallel", False)):
        add(f"{actor}.megatron.context_parallel_size",
            "static context parallelism > 1 mis-normalizes seq-mean-token-mean on verl 0.9.1; "
            "use CP 1 or megatron.dynamic_context_parallel=true")

    # Exact parity.
    if is_consistent(cfg):
        env = runtime_env_vars(cfg)
        if env.get(BATCH_INVARIANT_ENV) != "1":
            add(f"{ENV_VARS_KEY}.{BATCH_INVARIANT_ENV}",
                "must be \"1\" with ZMRL_NUMERICS=consistent: verl forwards the shell's value (\"0\" if unset) otherwise")
        if _get(cfg, f"{rollout}.temperature", 1.0) != 1.0:
            add(f"{rollout}.temperature", "bit-exact parity needs temperature 1.0")
        if not _get(cfg, f"{rollout}.calculate_log_probs", False):
            add(f"{rollout}.calculate_log_probs", "must be true: parity is checked against the recorded mu")
        if (_get(cfg, f"{rollout}.enable_prefix_caching", True)
                and env.get(ALLOW_PREFIX_CACHING_ENV) != "1"):
            add(f"{rollout}.enable_prefix_caching",
                f"is on, but the plugin's consistent mode turns it off unless {ALLOW_PREFIX_CACHING_ENV}=1; "
                "set one or the other so the config says what runs", fatal=False)
    return problems


def check_recipe(cfg: DictConfig) -> list[Problem]:
    """``zmrl validate-config``'s checks plus :func:`recipe_problems`."""
    return validate_config(cfg) + recipe_problems(cfg)


# ----- launching --------------------------------------------------------------------------------


def launch_command(name: str, overrides: Sequence[str] = (), python: str | None = None) -> list[str]:
    """``python -m verl.trainer.main_ppo --config-path=<this directory> --config-name=NAME overrides...``

    The recipe's environment (the consistent switch, ROCm GEMM routing) is part of the config
    (``ray_kwargs.ray_init.runtime_env.env_vars``), which verl hands to every Ray worker, so the
    command needs no environment of its own.
    """
    recipe_path(name)
    return [python or sys.executable, "-m", LAUNCHER_MODULE, f"--config-path={RECIPES_DIR}",
            f"--config-name={name}", *overrides]


def run_recipe(
    name: str,
    overrides: Sequence[str] = (),
    dry_run: bool = False,
    launcher: Callable[[list[str]], int] = subprocess.call,
    out: Callable[[str], None] = print,
    err: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> int:
    """Compose, validate, and launch verl's trainer (or print the command under ``dry_run``).

    Exit status: 2 if the recipe does not exist or compose, 1 if validation finds a fatal problem
    (the trainer is not started, also under ``dry_run``), else the launcher's status (0 for a dry run).
    """
    from zero_mismatch_plugin.validate_config import format_report

    try:
        cfg = compose_recipe(name, overrides)
    except RecipeError as error:
        err(f"ERROR: {error}")
        return 2
    problems = check_recipe(cfg)
    if any(problem.fatal for problem in problems):
        err(format_report(problems))
        err(f"refusing to launch {name!r}: fix the errors above")
        return 1
    for problem in problems:
        err(str(problem))
    command = launch_command(name, overrides)
    if dry_run:
        out(shlex.join(command))
        return 0
    return int(launcher(command))
