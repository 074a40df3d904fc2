"""Mismatch checker and bisector (``zmrl check``, ``zmrl bisect``).

``check`` runs a vLLM engine and a trainer backend (:mod:`.backends`) on the same weights and
reports whether the trainer reproduces the engine's logprobs bit for bit, and whether the engine
is consistent with itself; ``bisect`` names the first op that differs. See docs/alignment-playbook.md.
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
