"""Register the CPU platform with verl when the user opts in, and undo it."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("zero_mismatch_plugin")

ENABLE_ENV = "ZMRL_VERL_PLATFORM"
VERL_PLATFORM_ENV = "VERL_PLATFORM"
# verl registers its FSDP engines for the devices "cuda" and "npu" only. The engine code is
# device-generic (it asks the platform for the device), so the CPU selects the CUDA registration.
ENGINE_DEVICE_ENV = "VERL_ENGINE_DEVICE"
ENGINE_DEVICE_FOR_CPU = "cuda"

# The variables register_if_enabled set and their previous values (None: unset), while registered.
_saved_env: dict[str, str | None] = {}


class PlatformOptInError(ValueError):
    pass


def requested_platform() -> str | None:
    """The platform named by ``ZMRL_VERL_PLATFORM``, or None when unset (read by
    :mod:`zero_mismatch_plugin.tables.switches`: any value but ``cpu`` is refused)."""
    from zero_mismatch_plugin.tables.switches import SwitchError, choice

    try:
        return choice(ENABLE_ENV)
    except SwitchError as error:
        raise PlatformOptInError(
            f"{error}. The plugin provides only the 'cpu' platform: set {ENABLE_ENV}=cpu or unset it "
            "to let verl detect the accelerator") from None


def _resolved_platform_name() -> str | None:
    from verl.plugin.platform import platform_manager

    resolved = platform_manager._current_platform
    return None if resolved is None else resolved.device_name


def register_if_enabled() -> bool:
    """Register and select the CPU platform when ``ZMRL_VERL_PLATFORM=cpu``; True if it did.

    Must run before verl resolves its platform (``import verl`` does not; the first
    ``get_platform()`` does). Calling it again is a no-op.
    """
    name = requested_platform()
    if name is None:
        return False
    from zero_mismatch_plugin.tables.switches import cpu_kv_cache_space

    cpu_kv_cache_space()  # the rollout's vLLM engines get it (PlatformCPU.rollout_env_vars): refuse a bad one first
    from verl.plugin.platform import PlatformRegistry

    from zero_mismatch_plugin.integrations.verl.cpu.platform import PlatformCPU

    chosen = os.environ.get(VERL_PLATFORM_ENV, "").strip().lower()
    if chosen and chosen != name:
        raise PlatformOptInError(
            f"{ENABLE_ENV}={name} but {VERL_PLATFORM_ENV}={chosen!r}: unset one of them")
    resolved = _resolved_platform_name()
    if resolved is not None and resolved != "cpu":
        raise PlatformOptInError(
            f"{ENABLE_ENV}={name}, but verl already resolved its platform to {resolved!r} in process "
            f"{os.getpid()}; import the plugin before verl's first get_platform() "
            "(VERL_USE_EXTERNAL_MODULES=zero_mismatch_plugin.integrations.verl.cpu)")
    if PlatformRegistry.get(name) is not PlatformCPU:
        PlatformRegistry.register(platform=name)(PlatformCPU)
    _set_env(VERL_PLATFORM_ENV, name)
    if not os.environ.get(ENGINE_DEVICE_ENV):
        _set_env(ENGINE_DEVICE_ENV, ENGINE_DEVICE_FOR_CPU)
    from zero_mismatch_plugin.integrations.verl.cpu import patches, vllm_metadata

    vllm_metadata.install()
    patches.apply_all()
    return True


def register_loudly() -> bool:
    """:func:`register_if_enabled`, logging a failure at ERROR before re-raising it.

    verl logs an exception raised while loading a ``verl.plugins`` entry point at DEBUG only; the
    run would then go on towards CUDA and fail much later with an unrelated NCCL error.
    """
    try:
        return register_if_enabled()
    except Exception:
        from zero_mismatch_plugin.tables.switches import shown

        logger.error("zero_mismatch_plugin: %s, but the CPU platform could NOT be set up in process %d",
                     shown(ENABLE_ENV), os.getpid(), exc_info=True)
        raise


def unregister() -> None:
    """Undo :func:`register_if_enabled`: patches, registry entry and ``VERL_PLATFORM``."""
    from verl.plugin.platform import PlatformRegistry, platform_manager

    from zero_mismatch_plugin.integrations.verl.cpu import patches, vllm_metadata
    from zero_mismatch_plugin.integrations.verl.cpu.platform import PLATFORM_NAME, PlatformCPU

    patches.remove_all()
    vllm_metadata.uninstall()
    if PlatformRegistry._platforms.get(PLATFORM_NAME) is PlatformCPU:
        del PlatformRegistry._platforms[PLATFORM_NAME]
    if isinstance(platform_manager._current_platform, PlatformCPU):
        platform_manager._current_platform = None
    for key, previous in _saved_env.items():
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
    _saved_env.clear()


def _set_env(key: str, value: str) -> None:
    _saved_env.setdefault(key, os.environ.get(key))
    os.environ[key] = value
