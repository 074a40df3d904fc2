"""The one consistent/fast switch, shared by the engine (through the vLLM plugin) and the trainer.

``ZMRL_NUMERICS`` is read in every process: the vLLM plugin applies the engine side of the mode in
each vLLM process, the aligned trainer applies the trainer side. Setting it once, before the engine
starts, flips both sides together.

* ``consistent``: the engine and the trainer take paths whose bits do not depend on batch
  composition. On CUDA/ROCm/XPU this is vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``)
  in both processes. On CPU, vLLM's batch-invariant mode does not run (Triton kernels), so the
  switch selects the invariant CPU paths instead: no split-KV attention, and decode GEMMs with a
  single row padded to two rows where oneDNN's single-row kernel rounds differently; shapes that
  stay batch-variant are refused.
* ``fast``: nothing is changed; trainer and engine bits may differ.
* unset: the plugin leaves vLLM untouched.
"""

from __future__ import annotations

import contextlib
import os

MODE_ENV = "ZMRL_NUMERICS"
CONSISTENT = "consistent"
FAST = "fast"
MODES = (CONSISTENT, FAST)

# vLLM's CPU attention splits long KV ranges across threads for decode; the split changes the
# summation order relative to a prefill of the same rows.
CPU_SPLIT_KV_ENV = "VLLM_CPU_ATTN_SPLIT_KV"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def current_mode() -> str | None:
    mode = os.environ.get(MODE_ENV)
    if mode is None or mode == "":
        return None
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}; expected one of {MODES}")
    return mode


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


def set_mode(mode: str, platform: str | None = None) -> dict[str, str]:
    """Select ``mode`` for this process and every vLLM process it starts afterwards.

    Must run before the engine is created (vLLM reads these variables when its processes start).
    Returns the variables that were set.
    """
    if platform is None:
        from .vllm_compat import platform_kind

        platform = platform_kind()
    env = engine_env(mode, platform)
    if mode == FAST:
        # Leaving a previous consistent setting behind would keep one side invariant.
        for key in (CPU_SPLIT_KV_ENV, BATCH_INVARIANT_ENV):
            os.environ.pop(key, None)
    os.environ.update(env)
    return env


@contextlib.contextmanager
def temporary_environment(values: dict[str, str]):
    """Set ``values`` in ``os.environ`` for the block, then restore what was there.

    For settings an engine (or a process spawned for one) reads once when it starts.
    """
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
