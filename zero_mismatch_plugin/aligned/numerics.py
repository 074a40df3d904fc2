"""The one consistent/fast switch, shared by the engine (through the vLLM plugin) and the trainer.

``ZMRL_NUMERICS`` (``consistent``, ``fast`` or unset) is read in every process; set it once,
before the engine starts, with :func:`set_mode`, :func:`enable_consistent_numerics` or
``with consistent_numerics():``. Building a trainer never switches it. See docs/zero-mismatch.md.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

MODE_ENV = "ZMRL_NUMERICS"
CONSISTENT = "consistent"
FAST = "fast"
MODES = (CONSISTENT, FAST)

# vLLM's CPU attention splits long KV ranges across threads for decode; the split changes the
# summation order relative to a prefill of the same rows.
CPU_SPLIT_KV_ENV = "VLLM_CPU_ATTN_SPLIT_KV"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def current_mode() -> str | None:
    """``ZMRL_NUMERICS`` (None when unset); any other value than :data:`MODES` is refused with
    :class:`~zero_mismatch_plugin.tables.switches.SwitchError` (:mod:`zero_mismatch_plugin.tables.switches`)."""
    from zero_mismatch_plugin.tables.switches import choice

    return choice(MODE_ENV)


def is_consistent() -> bool:
    return current_mode() == CONSISTENT


def engine_env(mode: str, platform: str) -> dict[str, str]:
    """Environment variables the engine needs for ``mode`` on ``platform``."""
    if mode not in MODES:
        raise ValueError(f"unknown numerics mode {mode!r}")
    env = {MODE_ENV: mode}
    if mode == CONSISTENT:
        if platform == "cpu":
            env[CPU_SPLIT_KV_ENV] = "0"
        else:
            env[BATCH_INVARIANT_ENV] = "1"
    return env


def set_environment(values: dict[str, str]) -> dict[str, str | None]:
    """Set ``values`` in ``os.environ``; return what each key held before (None: unset)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    return saved


def restore_environment(saved: dict[str, str | None]) -> None:
    """Put back what :func:`set_environment` returned."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def temporary_environment(values: dict[str, str]):
    """Set ``values`` in ``os.environ`` for the block, then restore what was there.

    For settings an engine (or a process spawned for one) reads once when it starts.
    """
    saved = set_environment(values)
    try:
        yield
    finally:
        restore_environment(saved)


# ----- vLLM's batch-invariant mode in this process (CUDA / ROCm / XPU) ------------------------


def batch_invariance_on() -> bool:
    """Whether vLLM's batch-invariant overrides are installed in this process."""
    from zero_mismatch_plugin.aligned.vllm_compat import batch_invariant_module

    return bool(getattr(batch_invariant_module(), "_batch_invariant_MODE", False))


def _torch_backend_flags() -> dict:
    import torch

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return {
        (matmul, "fp32_precision"): matmul.fp32_precision,
        (matmul, "allow_fp16_reduced_precision_reduction"): matmul.allow_fp16_reduced_precision_reduction,
        (matmul, "allow_bf16_reduced_precision_reduction"): matmul.allow_bf16_reduced_precision_reduction,
        (cudnn.conv, "fp32_precision"): cudnn.conv.fp32_precision,
        (cudnn.rnn, "fp32_precision"): cudnn.rnn.fp32_precision,
    }


def _enable_batch_invariance() -> Callable[[], None] | None:
    """vLLM's ``init_batch_invariance()`` in this process (what its GPU workers call at start: aten
    overrides for mm/softmax/log_softmax/mean/bmm, TF32 and reduced-precision reductions off,
    cuBLASLt). Needs ``VLLM_BATCH_INVARIANT=1`` in ``os.environ``. Returns how to turn it off
    again, or None when it was on already (then it is not ours to turn off)."""
    import torch

    from zero_mismatch_plugin.aligned.vllm_compat import batch_invariant_module

    module = batch_invariant_module()
    if getattr(module, "_batch_invariant_MODE", False):
        return None
    flags = _torch_backend_flags()
    bmm = torch.bmm
    blas = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    module.init_batch_invariance()

    def disable() -> None:
        # vLLM has no switch-off; these are the globals its enable_batch_invariant_mode sets.
        library = getattr(module, "_batch_invariant_LIB", None)
        if library is not None:
            library._destroy()
        module._batch_invariant_LIB = None
        module._batch_invariant_MODE = False
        torch.bmm = bmm
        for (owner, name), value in flags.items():
            setattr(owner, name, value)
        if blas is not None:
            torch.backends.cuda.preferred_blas_library(blas)

    return disable


class ConsistentNumerics:
    """What :func:`enable_consistent_numerics` changed in this process; :meth:`undo` puts it back.

    Also a context manager (undone on exit).
    """

    def __init__(self, platform: str, saved_env: dict[str, str | None],
                 disable_batch_invariance: Callable[[], None] | None):
        self.platform = platform
        self.saved_env = saved_env
        self._disable_batch_invariance = disable_batch_invariance
        self.active = True

    def undo(self) -> None:
        """Turn off what this switch turned on (a second call does nothing). A CUDA context keeps
        the cuBLAS workspace settings it already read from the environment."""
        if not self.active:
            return
        self.active = False
        if self._disable_batch_invariance is not None:
            self._disable_batch_invariance()
        restore_environment(self.saved_env)

    def __enter__(self) -> "ConsistentNumerics":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def _changed_since(before: dict[str, str]) -> dict[str, str | None]:
    """The variables whose value differs from ``before``, with their value there (None: unset)."""
    keys = set(before) | set(os.environ)
    return {key: before.get(key) for key in keys if before.get(key) != os.environ.get(key)}


def enable_consistent_numerics(platform: str | None = None) -> ConsistentNumerics:
    """Consistent mode for this process and every vLLM engine it starts afterwards.

    Sets ``ZMRL_NUMERICS=consistent`` and the engine's variables (:func:`engine_env`), which the vLLM
    plugin and the engine processes read when they start, so it must run before the engine is
    created. On CUDA/ROCm/XPU it also switches on vLLM's batch-invariant mode in this process, which
    the trainer's forward needs; on CPU the trainer follows ``ZMRL_NUMERICS`` and nothing else is
    changed. The returned handle's ``undo()`` restores every variable it changed and turns off what
    it turned on.
    """
    if platform is None:
        from zero_mismatch_plugin.aligned.vllm_compat import platform_kind

        platform = platform_kind()
    before = dict(os.environ)
    set_environment(engine_env(CONSISTENT, platform))
    try:
        # vLLM's switch writes more variables (NCCL, cuBLAS): all are restored by undo().
        disable = _enable_batch_invariance() if platform != "cpu" else None
    except BaseException:
        restore_environment(_changed_since(before))
        raise
    return ConsistentNumerics(platform, _changed_since(before), disable)


@contextlib.contextmanager
def consistent_numerics(platform: str | None = None):
    """``with consistent_numerics():`` :func:`enable_consistent_numerics` for the block."""
    switch = enable_consistent_numerics(platform)
    try:
        yield switch
    finally:
        switch.undo()


# The switch set_mode turned on, so that set_mode("fast") can turn it off again.
_selected: ConsistentNumerics | None = None


def set_mode(mode: str, platform: str | None = None) -> dict[str, str]:
    """Select ``mode`` for this process and every vLLM process it starts afterwards.

    ``consistent`` is :func:`enable_consistent_numerics`; ``fast`` turns off a consistent mode
    selected here before and removes the consistent variables. Must run before the engine is
    created (vLLM reads these variables when its processes start). Returns the engine variables.
    """
    global _selected
    if platform is None:
        from zero_mismatch_plugin.aligned.vllm_compat import platform_kind

        platform = platform_kind()
    env = engine_env(mode, platform)
    if mode == CONSISTENT:
        if _selected is None or not _selected.active or _selected.platform != platform:
            if _selected is not None:
                _selected.undo()
            _selected = enable_consistent_numerics(platform)
        set_environment(env)
        return env
    if _selected is not None:
        _selected.undo()
        _selected = None
    # Leaving a previous consistent setting behind would keep one side invariant.
    for key in (CPU_SPLIT_KV_ENV, BATCH_INVARIANT_ENV):
        os.environ.pop(key, None)
    os.environ.update(env)
    return env


def require_trainer_numerics(mode: str | None, platform: str) -> None:
    """Refuse to build a trainer whose numbers would not be the engine's: consistent mode on a GPU
    needs vLLM's batch-invariant mode switched on in this process first."""
    if mode != CONSISTENT or platform == "cpu" or batch_invariance_on():
        return
    raise RuntimeError(
        f"{MODE_ENV}=consistent on {platform}, but vLLM's batch-invariant mode is off in this process, "
        "so the trainer would not compute the engine's bits. Switch it on before building the trainer: "
        "zero_mismatch_plugin.aligned.numerics.enable_consistent_numerics() (or `with consistent_numerics():`, "
        f"or set_mode('consistent')); or set {MODE_ENV}=fast."
    )
