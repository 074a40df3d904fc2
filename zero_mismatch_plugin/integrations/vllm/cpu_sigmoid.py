"""vLLM's MoE and gate sigmoids on CPU, made independent of the engine step's token count.

In consistent mode on CPU, GLM-4.5 / DeepSeek-V3 router scores (``cpu_router._grouped_topk``) and
the Qwen2-MoE shared-expert gate (``Qwen2MoeMLP.forward``, also Qwen3-Next's) and Qwen3-Next's
attention output gate (``Qwen3NextAttention.forward``) run with every sigmoid replaced by
``aligned.row_invariant.row_invariant_sigmoid``, as the aligned trainer computes them. Why:
docs/patches.md (``vllm/0005``).
"""

from __future__ import annotations

import functools

from zero_mismatch_plugin.integrations.vllm.patch_kinds import consistent_cpu_vllm_patch

ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.cpu_router"
QWEN2_MOE_MODULE = "vllm.model_executor.models.qwen2_moe"
QWEN3_NEXT_MODULE = "vllm.model_executor.models.qwen3_next"


@functools.cache
def row_invariant_sigmoids():
    """A torch function mode (a class; torch imported when first asked) inside which every
    out-of-place sigmoid is :func:`row_invariant_sigmoid`."""
    import torch
    from torch.overrides import TorchFunctionMode

    from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid

    sigmoids = (torch.sigmoid, torch.Tensor.sigmoid, torch.special.expit, torch.nn.functional.sigmoid)

    class RowInvariantSigmoids(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in sigmoids and len(args) == 1 and not kwargs:
                return row_invariant_sigmoid(args[0])
            return func(*args, **kwargs)

    return RowInvariantSigmoids


def with_row_invariant_sigmoids(original):
    """``original`` run with its sigmoids computed by :func:`row_invariant_sigmoid`."""

    @functools.wraps(original)
    def run(*args, **kwargs):
        with row_invariant_sigmoids()():
            return original(*args, **kwargs)

    return run


sigmoid_patch = functools.partial(consistent_cpu_vllm_patch, build=with_row_invariant_sigmoids)

ROUTER_SIGMOID = sigmoid_patch(
    f"{ROUTER_MODULE}:_grouped_topk",
    name="cpu-moe-router-sigmoid",
    why="GLM-4.5 / DeepSeek-V3 sigmoid router scores ([tokens, experts]) got other bits in the "
        "scalar tail of torch's CPU sigmoid depending on the token count: computed row-count-invariantly",
)

SHARED_EXPERT_GATE_SIGMOID = sigmoid_patch(
    f"{QWEN2_MOE_MODULE}:Qwen2MoeMLP.forward",
    name="cpu-qwen2-moe-shared-gate-sigmoid",
    why="Qwen2-MoE's shared-expert gate sigmoid ([tokens, 1]) got other bits in the scalar tail "
        "of torch's CPU sigmoid depending on the token count: computed row-count-invariantly",
)

ATTENTION_OUTPUT_GATE_SIGMOID = sigmoid_patch(
    f"{QWEN3_NEXT_MODULE}:Qwen3NextAttention.forward",
    name="cpu-qwen3-next-attention-gate-sigmoid",
    why="Qwen3-Next's attention output gate sigmoid ([tokens, heads * head_dim]) is torch's CPU sigmoid, "
        "whose bits for an element depend on the call's size past one thread's share: computed "
        "row-count-invariantly, as the aligned trainer computes it",
)

CONSISTENT_MODE_PATCHES = [ROUTER_SIGMOID, SHARED_EXPERT_GATE_SIGMOID, ATTENTION_OUTPUT_GATE_SIGMOID]
