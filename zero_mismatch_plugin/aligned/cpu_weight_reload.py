"""What vLLM's CPU post-load processing misses when a model's weights are loaded a second time.

The aligned weight sync and verl's CPU rollout reload call these around vLLM's ``reload_weights``,
and the verl-cpu-training fork patch carries their source (``inspect.getsource``), so each is
self-contained: standard library only, imports inside the body, no plugin names.
"""

from __future__ import annotations


def repack_shared_cpu_weights(model):
    """Re-derive CPU GEMM handles of layers whose weight another layer owns; return how many.

    On CPU an embedding-method layer keeps its weight and a oneDNN handle packed from it. A tied
    lm_head shares the embedding's weight but loads nothing itself, so vLLM's reload updates the
    shared weight and leaves the lm_head's handle packed from the old values. Packing again from
    the current weight (vLLM's own dispatch, weight kept) fixes that; for untied layers it
    reproduces the handle the reload already built.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
            and hasattr(module, "cpu_linear")
            and isinstance(weight, torch.Tensor)
            and weight.numel() > 0
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


def reprocess_moe_as_first_load(model):
    """Make the next post-load processing of every CPU MoE layer in ``model`` a first load.

    vLLM treats a second ``process_weights_after_loading`` of an unquantized MoE layer as a
    weight update: it copies the new checkpoint-layout weights into the processed storage and
    skips the experts' own processing. On CPU that processing zero-pads the expert width to a
    multiple of 32 and pre-packs both weights, so an update would feed the kernel unpadded,
    unpacked weights (a shape error when the width is padded, wrong numbers otherwise). Dropping
    the built kernel sends the next processing through the first-load path: pad, pack, rebuild.
    Returns how many layers were reset.
    """
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    reset = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, FusedMoEMethodBase) and getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            reset += 1
    return reset
