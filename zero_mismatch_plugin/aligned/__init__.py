"""Trainer-side forward that reproduces vLLM's sampled-token logprobs bit for bit.

Import the pieces lazily: nothing here imports vLLM until a runtime is created.
"""

from .numerics import CONSISTENT, FAST, MODE_ENV, current_mode, set_mode
from .packing import PackedBatch, pack
from .sampling import SamplingTransform, ZeroMismatchViolation
from .vllm_compat import UnsupportedVllmError

__all__ = [
    "AlignedCausalLM",
    "CONSISTENT",
    "FAST",
    "MODE_ENV",
    "PackedBatch",
    "SamplingTransform",
    "UnsupportedVllmError",
    "ZeroMismatchViolation",
    "current_mode",
    "pack",
    "set_mode",
]


def __getattr__(name):
    if name == "AlignedCausalLM":
        from .model import AlignedCausalLM

        return AlignedCausalLM
    raise AttributeError(name)
