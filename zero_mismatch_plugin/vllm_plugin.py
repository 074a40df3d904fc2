"""vLLM general plugin: the engine side of zero mismatch, applied in every vLLM process.

vLLM calls :func:`register` in the main process (when ``EngineArgs`` is created), in the
EngineCore and in every worker. It does nothing unless ``ZMRL_NUMERICS`` is set (see
:mod:`zero_mismatch_plugin.aligned.numerics`). With ``ZMRL_NUMERICS=consistent`` it:

* fixes the engine settings that decide which numbers are computed and recorded, when the
  engine config is built: lm_head in fp32 (``hf_overrides.head_dtype``), ``processed_logprobs``
  (the distribution actually sampled from), eager execution (compiled graphs round differently
  from the trainer's eager ops), a seed, no prefix caching (cache hits are computed with other
  shapes, and survive weight updates), and the weight-sync worker extension;
* on CUDA/ROCm/XPU sets ``VLLM_BATCH_INVARIANT=1`` for every process;
* on CPU, where vLLM's batch-invariant mode cannot run, disables split-KV decode attention and
  pads single-row GEMMs to two rows (see :mod:`zero_mismatch_plugin.aligned.cpu_gemm`).

``ZMRL_NUMERICS=fast`` only adds the weight-sync worker extension. Safe to call repeatedly.

Each change to a vLLM function is a named wrapper that keeps the original: :func:`applied` lists
them and :func:`remove` puts the originals back (the environment variables set for vLLM's
processes stay).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

logger = logging.getLogger(__name__)

# name -> (owner, attribute, original) of every vLLM function wrapped in this process.
_ORIGINALS: dict[str, tuple[object, str, Callable]] = {}

PREFIX_CACHING_ENV = "ZMRL_ALLOW_PREFIX_CACHING"


def register() -> None:
    from .aligned import numerics

    mode = numerics.current_mode()
    if mode is None:
        return
    _patch_engine_args()
    if mode != numerics.CONSISTENT:
        return
    try:
        from .aligned.vllm_compat import platform_kind

        platform = platform_kind()
    except Exception as exc:  # a plugin must not take the engine down
        logger.error("zero-mismatch plugin: cannot determine the vLLM platform: %s", exc)
        return
    for key, value in numerics.engine_env(mode, platform).items():
        os.environ[key] = value
    if platform == "cpu":
        _patch_cpu_gemm()
        _patch_cpu_mla()


def _wrap(name: str, owner, attribute: str, make_wrapper) -> None:
    """Replace ``owner.attribute`` by ``make_wrapper(original)`` once, keeping the original."""
    if name in _ORIGINALS:
        return
    original = getattr(owner, attribute)
    wrapper = make_wrapper(original)
    wrapper.__wrapped__ = original
    setattr(owner, attribute, wrapper)
    _ORIGINALS[name] = (owner, attribute, original)


def applied() -> list[str]:
    """The names of the vLLM functions the plugin has wrapped in this process."""
    from . import runtime_patches
    from .vllm_cpu_mla import CONSISTENT_MODE_PATCHES

    return sorted([*_ORIGINALS, *(p.name for p in CONSISTENT_MODE_PATCHES
                                      if runtime_patches.is_applied(p) or runtime_patches.is_pending(p))])


def remove() -> list[str]:
    """Put back every vLLM function the plugin wrapped in this process; return their names."""
    from . import runtime_patches
    from .vllm_cpu_mla import CONSISTENT_MODE_PATCHES

    removed = []
    for patch in CONSISTENT_MODE_PATCHES:
        if runtime_patches.is_applied(patch) or runtime_patches.is_pending(patch):
            runtime_patches.remove(patch)
            removed.append(patch.name)
    while _ORIGINALS:
        name, (owner, attribute, original) = _ORIGINALS.popitem()
        setattr(owner, attribute, original)
        removed.append(name)
    return sorted(removed)


def _patch_cpu_gemm() -> None:
    import vllm.model_executor.layers.utils as layer_utils

    from .aligned.cpu_gemm import pad_single_row

    def make(original):
        def dispatch_cpu_unquantized_gemm(layer, remove_weight):
            original(layer, remove_weight)
            if hasattr(layer, "cpu_linear"):
                layer.cpu_linear = pad_single_row(layer.cpu_linear)

        return dispatch_cpu_unquantized_gemm

    _wrap("cpu_gemm", layer_utils, "dispatch_cpu_unquantized_gemm", make)


def _patch_cpu_mla() -> None:
    from . import runtime_patches
    from .vllm_cpu_mla import CONSISTENT_MODE_PATCHES

    for patch in CONSISTENT_MODE_PATCHES:
        runtime_patches.apply(patch)


def consistent_engine_settings(args) -> list[str]:
    """Apply the consistent-mode settings to an ``EngineArgs``; return what was changed."""
    changed = []

    def setattr_if(name, value):
        if getattr(args, name, None) != value:
            setattr(args, name, value)
            changed.append(f"{name}={value!r}")

    overrides = args.hf_overrides
    if overrides is None:
        args.hf_overrides = {"head_dtype": "float32"}
        changed.append("hf_overrides.head_dtype='float32'")
    elif isinstance(overrides, dict) and "head_dtype" not in overrides:
        args.hf_overrides = {**overrides, "head_dtype": "float32"}
        changed.append("hf_overrides.head_dtype='float32'")
    elif callable(overrides):

        def with_fp32_head(config, _inner=overrides):
            config = _inner(config)
            if getattr(config, "head_dtype", None) is None:
                config.head_dtype = "float32"
            return config

        args.hf_overrides = with_fp32_head
        changed.append("hf_overrides.head_dtype='float32'")
    if args.logprobs_mode == "raw_logprobs":
        setattr_if("logprobs_mode", "processed_logprobs")
    setattr_if("enforce_eager", True)
    if args.seed is None:
        setattr_if("seed", 0)
    if os.environ.get(PREFIX_CACHING_ENV) != "1":
        setattr_if("enable_prefix_caching", False)
    return changed


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from .aligned import numerics
    from .aligned.weight_sync import WORKER_EXTENSION

    def make(original):
        def create_engine_config(self, *args, **kwargs):
            mode = numerics.current_mode()
            if mode is not None and not self.worker_extension_cls:
                self.worker_extension_cls = WORKER_EXTENSION
            if mode == numerics.CONSISTENT:
                changed = consistent_engine_settings(self)
                if changed:
                    logger.info("zero-mismatch (consistent): engine settings %s", ", ".join(changed))
            return original(self, *args, **kwargs)

        return create_engine_config

    _wrap("engine_args", EngineArgs, "create_engine_config", make)
