"""vLLM's CPU GEMM is batch-variant at M=1 for large K: detected, refused, or avoided.

Runs last among the engine tests (file order): it needs its own checkpoint (K=2816).
"""

import pytest
import torch

from vllm_session import prompts_for, rollout

from zero_mismatch_plugin.aligned import pack
from zero_mismatch_plugin.aligned.cpu_gemm import (
    BatchVariantShapeError,
    pad_single_row,
    probe_linear,
    require_invariant,
)


def _vllm_packed_linear(n, k, seed=0):
    """vLLM's own CPU dispatch (unpatched) for a random [n, k] weight: returns apply(x)."""
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from zero_mismatch_plugin.aligned.runtime import KernelLayer

    dispatch = getattr(layer_utils.dispatch_cpu_unquantized_gemm, "__wrapped__", None)
    dispatch = dispatch or layer_utils.dispatch_cpu_unquantized_gemm
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    layer = KernelLayer(weight, None, UnquantizedLinearMethod())
    dispatch(layer, remove_weight=False)
    return layer


def test_single_row_gemm_at_large_k_is_detected_and_refused():
    layer = _vllm_packed_linear(256, 2816)
    probe = probe_linear(lambda x: layer.cpu_linear(x, layer.weight, None), n=256, k=2816)
    # vLLM's oneDNN GEMM: M=1 rounds differently from M>=2 here, every M>=2 agrees.
    assert probe.variant_rows == [1]
    with pytest.raises(BatchVariantShapeError, match="M in \\[1\\]"):
        require_invariant(probe, "down_proj")


def test_small_k_gemm_is_invariant():
    layer = _vllm_packed_linear(256, 128)
    probe = probe_linear(lambda x: layer.cpu_linear(x, layer.weight, None), n=256, k=128)
    assert probe.invariant


def test_single_row_padding_makes_large_k_invariant():
    layer = _vllm_packed_linear(256, 2816)
    padded = pad_single_row(layer.cpu_linear)
    probe = probe_linear(lambda x: padded(x, layer.weight, None), n=256, k=2816)
    assert probe.invariant


def test_plugin_pads_vllm_dispatch_in_consistent_mode():
    from zero_mismatch_plugin import vllm_plugin
    from zero_mismatch_plugin.aligned.cpu_gemm import is_single_row_padded

    vllm_plugin.register()
    vllm_plugin.register()  # safe to call repeatedly
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from zero_mismatch_plugin.aligned.runtime import KernelLayer

    layer = KernelLayer(torch.randn(256, 2816), None, UnquantizedLinearMethod())
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    assert is_single_row_padded(layer.cpu_linear)
    assert not is_single_row_padded(getattr(layer.cpu_linear, "__wrapped__", None))


def test_lone_sequence_decode_at_large_k_is_bitwise_equal(engines, trainers):
    """End to end: the engine decodes ONE sequence (M=1 GEMMs, K=2816) and still matches."""
    name = "llama_wide"
    llm = engines.get(name)
    trainer = trainers(name)
    shapes = {tuple(lin.derived.get()[1].shape) for lin in trainer.all_linears().values()}
    assert (256, 2816) in shapes  # down_proj of the wide model: the batch-variant K
    prompt = prompts_for(trainer.runtime.model_dir, num_prompts=1)
    prompts, responses, mu = rollout(llm, prompt, seed=400, n=1, max_tokens=20)
    assert len(responses) == 1 and len(responses[0]) == 20
    with torch.no_grad():
        logprobs = trainer.token_logprobs(pack(prompts, responses))
    assert torch.equal(logprobs, mu), f"{(logprobs == mu).float().mean().item():.1%} equal"
