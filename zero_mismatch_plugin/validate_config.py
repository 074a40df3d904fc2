"""``zmrl validate-config``: compose a verl config as verl would and check what the
plugin's algorithms require, reporting every problem at once with the key to change.

The checks are plain functions over the composed ``DictConfig``; Hydra is only used to
compose it (``compose_verl_config``), exactly as ``python -m verl.trainer.main_ppo
--config-path DIR --config-name NAME overrides...`` would.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from zero_mismatch_plugin.verl_adapter import (
    ADVANTAGE_ESTIMATORS,
    PLUGIN_POLICY_LOSS_CONFIG,
    POLICY_LOSSES,
    verl_passes_rollout_log_probs,
)

REINFORCE_ZERO = "reinforce_zero"
FLASH_REINFORCE = "flash_reinforce"
# Trainer modes whose advantage estimator sees the whole train batch. separate_async
# computes advantages per chunk of train_batch_size // parameter_sync_step prompts.
WHOLE_BATCH_TRAINER_MODES = ("sync", "colocate_async")


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    fatal: bool = True

    def __str__(self) -> str:
        return f"{'ERROR' if self.fatal else 'warning'}: {self.key}: {self.message}"


def compose_verl_config(config_path: str | Path, config_name: str, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose ``config_name`` from ``config_path`` with Hydra overrides, as verl's launcher does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = Path(config_path).expanduser().resolve()
    if not config_dir.is_dir():
        raise FileNotFoundError(f"--config-path {config_path}: no such directory")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(cfg, key, default=default)
    return value


def _locate(target: str) -> type:
    module_name, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def _check_policy_loss_keys(cfg: DictConfig, uses_flash: bool) -> list[Problem]:
    """Unknown keys under policy_loss would fail in every worker at start-up: catch them here."""
    key = "actor_rollout_ref.actor.policy_loss"
    policy_loss = _get(cfg, key)
    if policy_loss is None:
        return [Problem(key, "missing")]
    target = policy_loss.get("_target_", "verl.workers.config.PolicyLossConfig")
    try:
        config_cls = _locate(target)
    except (ImportError, AttributeError) as error:
        return [Problem(f"{key}._target_", f"cannot import {target!r}: {error}")]
    known = {field.name for field in dataclasses.fields(config_cls)} | {"_target_"}
    plugin_known = {field.name for field in dataclasses.fields(_locate(PLUGIN_POLICY_LOSS_CONFIG))}
    problems = []
    for name in policy_loss.keys():
        if name in known:
            continue
        if name in plugin_known:
            problems.append(Problem(f"{key}.{name}", f"is a plugin key but {key}._target_ is {target}; "
                                                     f"set {key}._target_={PLUGIN_POLICY_LOSS_CONFIG}"))
        else:
            problems.append(Problem(f"{key}.{name}", f"unknown key for {target} (known: {sorted(known - {'_target_'})})"))
    if problems:
        return problems
    if uses_flash and target != PLUGIN_POLICY_LOSS_CONFIG:
        problems.append(Problem(f"{key}._target_", f"flash_reinforce's trust-region settings live on "
                                                   f"{PLUGIN_POLICY_LOSS_CONFIG}; without it the defaults apply",
                                fatal=False))
    try:
        from verl.utils.config import omega_conf_to_dataclass

        omega_conf_to_dataclass(policy_loss)
    except Exception as error:  # noqa: BLE001 - any construction failure is the user's to fix
        problems.append(Problem(key, f"does not build: {error}"))
    return problems


def _check_actor_builds(cfg: DictConfig) -> list[Problem]:
    """Build the actor dataclass as every verl worker will, so its own checks fail here, not on a cluster."""
    from verl.utils.config import omega_conf_to_dataclass

    try:
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    except Exception as error:  # noqa: BLE001
        return [Problem("actor_rollout_ref.actor", f"verl cannot build the actor config: {error}")]
    return []


def _unregistered_names(estimator: str, loss_mode: str) -> list[Problem]:
    """verl only notices an unknown name at first use, deep in a run; catch it here.

    The same check is what the verl-reject-unknown-names patch adds to verl itself.
    """
    import verl  # noqa: F401  (loads every verl.plugins entry point, this plugin's included)
    from verl.trainer.ppo import core_algos

    from zero_mismatch_plugin.patching.shared import require_registered_name

    problems = []
    for key, name, registry, kind in (
        ("algorithm.adv_estimator", estimator, core_algos.ADV_ESTIMATOR_REGISTRY, "advantage estimator"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", loss_mode, core_algos.POLICY_LOSS_REGISTRY, "policy loss"),
    ):
        try:
            require_registered_name(key, name, registry, kind)
        except ValueError as error:
            problems.append(Problem(key, str(error)))
    return problems


def validate_config(cfg: DictConfig) -> list[Problem]:
    """Every requirement of reinforce_zero / flash_reinforce that ``cfg`` violates."""
    estimator = str(_get(cfg, "algorithm.adv_estimator"))
    loss_mode = str(_get(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode"))
    problems: list[Problem] = _unregistered_names(estimator, loss_mode)
    uses_plugin_estimator = estimator in ADVANTAGE_ESTIMATORS
    uses_plugin_loss = loss_mode in POLICY_LOSSES
    if not (uses_plugin_estimator or uses_plugin_loss):
        return problems
    uses_flash = FLASH_REINFORCE in (estimator, loss_mode)

    def require(key: str, ok: bool, message: str, fatal: bool = True) -> None:
        if not ok:
            problems.append(Problem(key, f"{message} (now {_get(cfg, key)!r})", fatal))

    if uses_plugin_estimator and uses_plugin_loss and estimator != loss_mode:
        problems.append(Problem("algorithm.adv_estimator",
                                f"{estimator} advantages with the {loss_mode} loss is neither paper's algorithm",
                                fatal=False))

    require("algorithm.rollout_correction.bypass_mode",
            _get(cfg, "algorithm.rollout_correction.bypass_mode") is True or verl_passes_rollout_log_probs(),
            "must be true: the loss must see the rollout's own logprob mu as old_log_prob "
            "(or run a verl whose ppo_loss passes rollout_log_probs: patches/verl/0003)")
    require("actor_rollout_ref.rollout.calculate_log_probs",
            _get(cfg, "actor_rollout_ref.rollout.calculate_log_probs") is True,
            "must be true: mu is the logprob the rollout engine recorded while sampling")
    if uses_plugin_loss:
        require("trainer.use_v1", _get(cfg, "trainer.use_v1", False) is True,
                "must be true: the legacy trainer replaces policy_loss.loss_mode with 'bypass_mode' in bypass mode")
        require("actor_rollout_ref.actor.loss_agg_mode",
                _get(cfg, "actor_rollout_ref.actor.loss_agg_mode") == "seq-mean-token-mean",
                "must be seq-mean-token-mean: average within each response, then over responses")
        for key in ("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_rs"):
            require(key, _get(cfg, key) is None,
                    "must be null: the plugin's loss applies its own unclipped IS; verl's bypass-mode "
                    "weights/rejection would not be applied")
        policy_loss_problems = _check_policy_loss_keys(cfg, uses_flash)
        problems += policy_loss_problems
        if not any(p.fatal for p in policy_loss_problems):  # otherwise the same error twice
            problems += _check_actor_builds(cfg)

    top_p = _get(cfg, "actor_rollout_ref.rollout.top_p", 1.0)
    top_k = _get(cfg, "actor_rollout_ref.rollout.top_k", -1)
    require("actor_rollout_ref.rollout.top_p", top_p is None or float(top_p) >= 1.0,
            "must be 1.0: top-p truncation breaks the common support that importance sampling assumes")
    require("actor_rollout_ref.rollout.top_k", top_k is None or int(top_k) <= 0,
            "must be -1 (off): top-k truncation breaks the common support that importance sampling assumes")
    temperature = _get(cfg, "actor_rollout_ref.rollout.temperature", 1.0)
    require("actor_rollout_ref.rollout.temperature", float(temperature) == 1.0,
            "bit-exact logprob parity is only established at temperature 1.0", fatal=False)

    if uses_flash:
        require("actor_rollout_ref.rollout.n", int(_get(cfg, "actor_rollout_ref.rollout.n", 1)) == 1,
                "must be 1: FlashREINFORCE uses one rollout per prompt and a batch baseline")
        require("actor_rollout_ref.actor.ppo_epochs", int(_get(cfg, "actor_rollout_ref.actor.ppo_epochs", 1)) == 1,
                "must be 1: FlashREINFORCE takes exactly one update per batch, then discards it")
        mode = str(_get(cfg, "trainer.v1.trainer_mode", "sync"))
        train_batch = int(_get(cfg, "data.train_batch_size"))
        mini_batch = int(_get(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size"))
        if mode in WHOLE_BATCH_TRAINER_MODES:
            estimator_batch = train_batch
        elif mode == "separate_async":
            estimator_batch = train_batch // int(_get(cfg, "trainer.v1.separate_async.parameter_sync_step", 1))
        else:
            estimator_batch = None
            problems.append(Problem("trainer.v1.trainer_mode", f"unknown trainer mode {mode!r}"))
        if estimator_batch is not None and estimator_batch != mini_batch:
            problems.append(Problem(
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                f"must equal the batch the advantage baseline is taken over ({estimator_batch} prompts in "
                f"trainer mode {mode}); now {mini_batch}: one optimizer step per centered batch"))
    return problems


def format_report(problems: list[Problem]) -> str:
    if not problems:
        return "config OK for the zero-mismatch algorithms"
    fatal = sum(p.fatal for p in problems)
    lines = [str(p) for p in problems]
    lines.append(f"{fatal} error(s), {len(problems) - fatal} warning(s)")
    return "\n".join(lines)
