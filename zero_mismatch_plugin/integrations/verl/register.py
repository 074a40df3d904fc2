"""``verl.plugins`` entry point: registers the plugin's estimators and losses into verl.

``import verl`` imports this module in every process (driver, TaskRunner, Ray workers).
verl logs an entry point's exceptions at DEBUG only, so a failure here is reported at
WARNING (and re-raised) instead of surfacing later as "Unsupported loss mode".
"""

from __future__ import annotations

import logging
import os

from zero_mismatch_plugin.tables.switches import shown

logger = logging.getLogger("zero_mismatch_plugin")


def _register_once(registry: dict, decorator_factory, kind: str, name: str, fn) -> None:
    registered = registry.get(name)
    if registered is None:
        decorator_factory(name)(fn)
    elif registered is not fn:
        # verl's register_policy_loss would silently overwrite another plugin's function: refuse.
        raise RuntimeError(f"verl already has {kind} named {name!r} ({registered!r})")


def register() -> None:
    """Register estimators and losses; calling it again is a no-op."""
    from verl.trainer.ppo import core_algos

    from zero_mismatch_plugin.integrations.verl import estimators, losses

    for name, fn in (("reinforce_zero", estimators.reinforce_zero_advantage),
                     ("flash_reinforce", estimators.flash_reinforce_advantage)):
        _register_once(core_algos.ADV_ESTIMATOR_REGISTRY, core_algos.register_adv_est,
                       "an advantage estimator", name, fn)
    for name, fn in (("reinforce_zero", losses.reinforce_zero_policy_loss),
                     ("flash_reinforce", losses.flash_reinforce_policy_loss)):
        _register_once(core_algos.POLICY_LOSS_REGISTRY, core_algos.register_policy_loss,
                       "a policy loss", name, fn)


try:
    register()
except Exception as error:  # noqa: BLE001 - re-raised after being made visible
    logger.warning(
        "zero_mismatch_plugin FAILED to register its verl estimators/losses in process %d: %r. "
        "algorithm.adv_estimator / policy_loss.loss_mode 'reinforce_zero' and 'flash_reinforce' "
        "will be unavailable.", os.getpid(), error, exc_info=True)
    raise


def _apply_megatron_patch_if_enabled() -> None:
    """ZMRL_MEGATRON_ALIGNED=1: make verl's Megatron engine compute vLLM's logprobs.

    Off by default, and then nothing Megatron-related is imported.
    """
    from zero_mismatch_plugin.integrations.verl import megatron_engine

    try:
        megatron_engine.maybe_apply()
    except Exception:
        # verl would swallow the exception; training on without alignment must not go unnoticed.
        logger.error("zero_mismatch_plugin: %s, but the aligned Megatron patch could NOT be applied "
                     "in process %d; the trainer will NOT match vLLM's logprobs.",
                     shown(megatron_engine.ENABLE_ENV), os.getpid(), exc_info=True)
        raise


_apply_megatron_patch_if_enabled()


def _apply_fsdp_patch_if_enabled() -> None:
    """ZMRL_FSDP_ALIGNED=1: make verl's FSDP engine compute vLLM's logprobs (lazily: the patch is
    applied when verl imports its FSDP engine module)."""
    from zero_mismatch_plugin.integrations.verl import fsdp_engine

    try:
        fsdp_engine.maybe_apply()
    except Exception:
        logger.error("zero_mismatch_plugin: %s, but the aligned FSDP patch could NOT be applied in process %d; "
                     "the trainer will NOT match vLLM's logprobs.", shown(fsdp_engine.ENABLE_ENV), os.getpid(),
                     exc_info=True)
        raise


_apply_fsdp_patch_if_enabled()

# ZMRL_VERL_PLATFORM=cpu: verl's CPU platform (opt-in; otherwise this imports only os and logging).
import zero_mismatch_plugin.integrations.verl.cpu  # noqa: E402,F401
