"""What REINFORCE Zero and FlashREINFORCE need from a verl config (docs/algorithms.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

from omegaconf import DictConfig

from zero_mismatch_plugin.integrations.verl import (
    ADVANTAGE_ESTIMATORS,
    PLUGIN_POLICY_LOSS_CONFIG,
    POLICY_LOSSES,
    verl_passes_rollout_log_probs,
)

from zero_mismatch_plugin.tools.config_checks.problems import Problem
from zero_mismatch_plugin.tools.config_checks.values import on_cpu_platform, read

REINFORCE_ZERO = "reinforce_zero"
FLASH_REINFORCE = "flash_reinforce"
# Trainer modes whose advantage estimator sees the whole train batch. separate_async
# computes advantages per chunk of train_batch_size // parameter_sync_step prompts.
WHOLE_BATCH_TRAINER_MODES = ("sync", "colocate_async")
POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"


def uses_plugin(cfg: DictConfig) -> bool:
    return (read(cfg, "algorithm.adv_estimator") in ADVANTAGE_ESTIMATORS
            or read(cfg, f"{POLICY_LOSS}.loss_mode") in POLICY_LOSSES)


def _locate(target: str) -> type:
    module_name, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def _policy_loss_key_problems(cfg: DictConfig, uses_flash: bool) -> list[Problem]:
    """Unknown keys under policy_loss would fail in every worker at start-up: catch them here."""
    policy_loss = read(cfg, POLICY_LOSS)
    target = policy_loss.get("_target_", "verl.workers.config.PolicyLossConfig")
    try:
        config_cls = _locate(str(target))
    except (ImportError, AttributeError, ValueError) as error:
        return [Problem(f"{POLICY_LOSS}._target_", f"cannot import {target!r}: {error}")]
    known = {field.name for field in dataclasses.fields(config_cls)} | {"_target_"}
    plugin_known = {field.name for field in dataclasses.fields(_locate(PLUGIN_POLICY_LOSS_CONFIG))}
    problems = []
    for name in policy_loss.keys():
        if name in known:
            continue
        if name in plugin_known:
            problems.append(Problem(f"{POLICY_LOSS}.{name}", f"is a plugin key but {POLICY_LOSS}._target_ is {target}; "
                                                             f"set {POLICY_LOSS}._target_={PLUGIN_POLICY_LOSS_CONFIG}"))
        else:
            problems.append(Problem(f"{POLICY_LOSS}.{name}",
                                    f"unknown key for {target} (known: {sorted(known - {'_target_'})})"))
    if problems:
        return problems
    if uses_flash and target != PLUGIN_POLICY_LOSS_CONFIG:
        problems.append(Problem(f"{POLICY_LOSS}._target_", f"flash_reinforce's trust-region settings live on "
                                                           f"{PLUGIN_POLICY_LOSS_CONFIG}; without it the defaults apply",
                                fatal=False))
    try:
        from verl.utils.config import omega_conf_to_dataclass

        omega_conf_to_dataclass(policy_loss)
    except Exception as error:  # noqa: BLE001 - any construction failure is the user's to fix
        problems.append(Problem(POLICY_LOSS, f"does not build: {error}"))
    return problems


def _actor_build_problems(cfg: DictConfig) -> list[Problem]:
    """Build the actor dataclass as every verl worker will, so its own checks fail here, not on a cluster."""
    from verl.utils.config import omega_conf_to_dataclass

    platform_checks = contextlib.nullcontext()
    if on_cpu_platform(cfg):
        from zero_mismatch_plugin.integrations.verl.cpu.patches import config_checks_applied

        platform_checks = config_checks_applied()
    try:
        with platform_checks:
            omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    except Exception as error:  # noqa: BLE001
        return [Problem("actor_rollout_ref.actor", f"verl cannot build the actor config: {error}")]
    return []


def unregistered_name_problems(cfg: DictConfig) -> list[Problem]:
    """verl only notices an unknown name at first use, deep in a run; catch it here.

    The same check is what the verl-reject-unknown-names patch adds to verl itself.
    """
    import verl  # noqa: F401  (loads every verl.plugins entry point, this plugin's included)
    from verl.trainer.ppo import core_algos

    from zero_mismatch_plugin.integrations.verl.call_guards import require_registered_name

    problems = []
    for key, registry, kind in (
        ("algorithm.adv_estimator", core_algos.ADV_ESTIMATOR_REGISTRY, "advantage estimator"),
        (f"{POLICY_LOSS}.loss_mode", core_algos.POLICY_LOSS_REGISTRY, "policy loss"),
    ):
        try:
            require_registered_name(key, read(cfg, key), registry, kind)
        except ValueError as error:
            problems.append(Problem(key, str(error)))
    return problems


def _require(problems: list[Problem], cfg: DictConfig, key: str, ok: bool, message: str) -> None:
    if not ok:
        problems.append(Problem(key, f"{message} (now {read(cfg, key)!r})"))


def _shared_problems(cfg: DictConfig, uses_loss: bool) -> list[Problem]:
    """What both algorithms need: mu reaching the loss, the V1 trainer, the loss's own IS."""
    problems: list[Problem] = []
    _require(problems, cfg, "algorithm.rollout_correction.bypass_mode",
             read(cfg, "algorithm.rollout_correction.bypass_mode") or verl_passes_rollout_log_probs(),
             "must be true: the loss must see the rollout's own logprob mu as old_log_prob "
             "(or run a verl whose ppo_loss passes rollout_log_probs: patches/verl/0003)")
    if not uses_loss:
        return problems
    _require(problems, cfg, "trainer.use_v1", read(cfg, "trainer.use_v1"),
             "must be true: the legacy trainer replaces policy_loss.loss_mode with 'bypass_mode' in bypass mode")
    _require(problems, cfg, "actor_rollout_ref.actor.loss_agg_mode",
             read(cfg, "actor_rollout_ref.actor.loss_agg_mode") == "seq-mean-token-mean",
             "must be seq-mean-token-mean: average within each response, then over responses")
    for key in ("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_rs"):
        _require(problems, cfg, key, read(cfg, key) is None,
                 "must be null: the plugin's loss applies its own unclipped IS; verl's bypass-mode "
                 "weights/rejection would not be applied")
    return problems


def _group_size_problems(cfg: DictConfig, estimator: str) -> list[Problem]:
    n = read(cfg, "actor_rollout_ref.rollout.n")
    if estimator == REINFORCE_ZERO and n < 2:
        return [Problem("actor_rollout_ref.rollout.n",
                        f"must be at least 2 with reinforce_zero (now {n}): its advantage is centered on each "
                        "prompt's group mean, so a group of one response gets advantage 0 and nothing is learned; "
                        "for one rollout per prompt use flash_reinforce (batch-centered advantage)")]
    return []


def estimator_batch(cfg: DictConfig) -> tuple[str, int]:
    """The trainer mode and the number of prompts the advantage estimator sees at once."""
    mode = read(cfg, "trainer.v1.trainer_mode")
    train_batch = read(cfg, "data.train_batch_size")
    if mode in WHOLE_BATCH_TRAINER_MODES:
        return mode, train_batch
    return mode, train_batch // read(cfg, "trainer.v1.separate_async.parameter_sync_step")


def _flash_reinforce_problems(cfg: DictConfig) -> list[Problem]:
    problems: list[Problem] = []
    _require(problems, cfg, "actor_rollout_ref.rollout.n", read(cfg, "actor_rollout_ref.rollout.n") == 1,
             "must be 1: FlashREINFORCE uses one rollout per prompt and a batch baseline")
    _require(problems, cfg, "actor_rollout_ref.actor.ppo_epochs", read(cfg, "actor_rollout_ref.actor.ppo_epochs") == 1,
             "must be 1: FlashREINFORCE takes exactly one update per batch, then discards it")
    mode, batch = estimator_batch(cfg)
    mini_batch = read(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")
    if batch != mini_batch:
        problems.append(Problem(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"must equal the batch the advantage baseline is taken over ({batch} prompts in "
            f"trainer mode {mode}); now {mini_batch}: one optimizer step per centered batch"))
    return problems


def algorithm_problems(cfg: DictConfig) -> list[Problem]:
    """Every requirement of reinforce_zero / flash_reinforce that ``cfg`` violates."""
    problems = unregistered_name_problems(cfg)
    estimator = read(cfg, "algorithm.adv_estimator")
    loss_mode = read(cfg, f"{POLICY_LOSS}.loss_mode")
    uses_estimator, uses_loss = estimator in ADVANTAGE_ESTIMATORS, loss_mode in POLICY_LOSSES
    if not (uses_estimator or uses_loss):
        return problems
    uses_flash = FLASH_REINFORCE in (estimator, loss_mode)
    if estimator != loss_mode:  # e.g. the policy_loss block removed: verl's default loss runs
        problems.append(Problem("algorithm.adv_estimator",
                                f"{estimator} advantages with the {loss_mode} loss is neither paper's algorithm",
                                fatal=False))
    problems += _shared_problems(cfg, uses_loss)
    if uses_loss:
        policy_loss_problems = _policy_loss_key_problems(cfg, uses_flash)
        problems += policy_loss_problems
        if not any(p.fatal for p in policy_loss_problems):  # otherwise the same error twice
            problems += _actor_build_problems(cfg)
    problems += _group_size_problems(cfg, estimator)
    if uses_flash:
        problems += _flash_reinforce_problems(cfg)
    return problems
