"""Mismatch checker and bisector (``zmrl check``, ``zmrl bisect``).

``check`` runs a real vLLM engine and a trainer backend on the same weights and reports, as
pass/fail with figures, whether the trainer reproduces the engine's logprobs bit for bit, and
whether the engine itself is consistent across batch composition, prefix-cache hits and
prefill vs decode. ``bisect`` runs vLLM's own modules and the trainer's side by side on one input
and names the first op whose output differs. Trainer backends are pluggable
(:mod:`.backends`).
"""

from .backends import (
    KNOWN_TRAINERS,
    TRAINER_BACKENDS,
    BackendUnavailable,
    TrainerBackend,
    load_backend,
)
from .checks import CHECK_NAMES, CheckOptions, CheckResult, run_checks

__all__ = [
    "BackendUnavailable",
    "CHECK_NAMES",
    "CheckOptions",
    "CheckResult",
    "KNOWN_TRAINERS",
    "TRAINER_BACKENDS",
    "TrainerBackend",
    "load_backend",
    "run_checks",
]
