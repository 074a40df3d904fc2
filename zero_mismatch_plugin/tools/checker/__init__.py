"""Mismatch checker and bisector (``zmrl check``, ``zmrl bisect``).

``check`` runs a real vLLM engine and a trainer backend on the same weights and reports, as
pass/fail with figures, whether the trainer reproduces the engine's logprobs bit for bit, and
whether the engine itself is consistent across batch composition, prefix-cache hits and
prefill vs decode. ``bisect`` runs vLLM's own modules and the trainer's side by side on one input
and names the first op whose output differs. Trainer backends are pluggable
(:mod:`.backends`).
"""

import importlib

# Where each public name lives; imported on first use, so that reading the trainer names
# (:mod:`.registry`, for the command line) does not import torch.
_EXPORTS = {
    "BackendUnavailable": ".backends",
    "TrainerBackend": ".backends",
    "load_backend": ".backends",
    "KNOWN_TRAINERS": ".registry",
    "TRAINER_BACKENDS": ".registry",
    "CHECK_NAMES": ".checks",
    "CheckOptions": ".checks",
    "CheckResult": ".checks",
    "run_checks": ".checks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
