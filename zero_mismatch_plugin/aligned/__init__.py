"""The op layer: vLLM's own kernels as trainer ops with backward passes, and the logprob tail.

Nothing here imports vLLM until a runtime is created. The trainer faces built on it are in
:mod:`zero_mismatch_plugin.faces`.
"""

from zero_mismatch_plugin.aligned.numerics import CONSISTENT, FAST, MODE_ENV, current_mode, set_mode
from zero_mismatch_plugin.aligned.packing import PackedBatch, pack
from zero_mismatch_plugin.aligned.sampling import SamplingTransform, ZeroMismatchViolation
from zero_mismatch_plugin.aligned.vllm_compat import UnsupportedVllmError

__all__ = [
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

