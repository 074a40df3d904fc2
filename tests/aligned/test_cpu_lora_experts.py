"""The CPU LoRA-capable experts' packing (aligned/cpu_lora_experts.py): each weight is packed through
vLLM's CPU linear dispatch once per load, not per call, and a LoRA buffer is packed again only after
it is written. A counting stand-in for the dispatch; the bitwise engine/trainer tests are in
tests/faces/aligned_model/test_aligned_expert_lora.py."""

import pytest
import torch

from zero_mismatch_plugin.aligned import cpu_lora_experts

E, H, I, R = 3, 16, 8, 4


@pytest.fixture
def dispatches(monkeypatch):
    """Every weight vLLM's CPU dispatch is asked to pack; the packed linear is F.linear on a copy."""
    from vllm.model_executor.layers import utils

    packed = []

    def dispatch(layer, remove_weight):
        weight = layer.weight.detach().clone()
        packed.append(weight)
        layer.cpu_linear = lambda x, _weight, bias: torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", dispatch)
    return packed


def _moe(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    x = torch.randn(5, H, generator=gen)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    return x, w13, w2, weights, ids


def _reference(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = w13[e] @ x[t]
            out[t] += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate_up[:I]) * gate_up[I:]))
    return out


def test_expert_weights_are_packed_once_per_load_not_per_call(dispatches):
    x, w13, w2, weights, ids = _moe()
    linears = cpu_lora_experts.expert_linears(w13, w2)
    assert len(dispatches) == 2 * E
    for _ in range(3):
        out = cpu_lora_experts.cpu_moe_experts(x, w13, w2, weights, ids, linears=linears)
    assert len(dispatches) == 2 * E  # the calls used the packed linears
    assert torch.allclose(out, _reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    # Without packed linears every call packs (what the engine's load-time packing saves).
    cpu_lora_experts.cpu_moe_experts(x, w13, w2, weights, ids)
    assert len(dispatches) == 4 * E


def test_the_experts_apply_uses_the_linears_packed_at_load_for_those_weights_only(dispatches):
    x, w13, w2, weights, ids = _moe()
    layer = torch.nn.Module()
    layer.w13_weight, layer.w2_weight = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    experts = type("Experts", (), {"w1_bias": None, "w2_bias": None, "_lora_context": None})()
    cpu_lora_experts.pack_cpu_lora_experts(experts, layer)
    assert len(dispatches) == 2 * E
    output = torch.empty(5, H)
    cpu_lora_experts.cpu_lora_experts_apply(experts, output, x, layer.w13_weight, layer.w2_weight, weights, ids,
                                            None, False)
    assert len(dispatches) == 2 * E
    assert torch.allclose(output, _reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    # Other weights than the ones packed at load (another tensor): packed for the call, not reused.
    other = w13.clone() * 2
    cpu_lora_experts.cpu_lora_experts_apply(experts, output, x, other, layer.w2_weight, weights, ids, None, False)
    assert len(dispatches) == 4 * E
    assert torch.allclose(output, _reference(x, other, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_a_lora_buffer_is_packed_on_first_use_and_again_only_after_a_write(dispatches):
    gen = torch.Generator().manual_seed(1)
    stacked = torch.randn(2, E, R, H, generator=gen)  # [slots, experts, r, in]
    x = torch.randn(3, H, generator=gen)
    first = cpu_lora_experts.lora_linears(stacked, 1, 2)
    assert len(dispatches) == 1 and torch.allclose(first(x), x @ stacked[1, 2].t())
    assert cpu_lora_experts.lora_linears(stacked, 1, 2) is first and len(dispatches) == 1
    cpu_lora_experts.lora_linears(stacked, 0, 2)
    assert len(dispatches) == 2  # another (slot, expert): its own packing
    stacked[1, 2].copy_(torch.randn(R, H, generator=gen))  # an adapter loaded into slot 1
    again = cpu_lora_experts.lora_linears(stacked, 1, 2)
    assert again is not first and len(dispatches) == 3
    assert torch.allclose(again(x), x @ stacked[1, 2].t())


def _planted_dispatch(packed, variant_rows=frozenset()):
    """A dispatch whose linear computes each row alone (its bits cannot depend on the call), one ulp
    up for a call of ``variant_rows`` rows."""

    def dispatch(layer, remove_weight):
        weight = layer.weight.detach().clone()
        packed.append(weight)

        def linear(x, _weight, bias):
            out = torch.stack([weight @ row for row in x]) if x.shape[0] else x.new_empty(0, weight.shape[0])
            return torch.nextafter(out, torch.full_like(out, float("inf"))) if x.shape[0] in variant_rows else out

        layer.cpu_linear = linear

    return dispatch


def test_the_trainers_probe_refuses_a_packed_shape_whose_rows_depend_on_the_row_count(monkeypatch):
    """require_invariant_packed_gemms probes each distinct shape and dtype once, through the same
    packing, and names the weight whose kernel rounds a row by the call's row count (planted at 3 rows)."""
    from vllm.model_executor.layers import utils

    from zero_mismatch_plugin.aligned.cpu_gemm import BatchVariantShapeError, require_invariant_packed_gemms

    packed = []
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", _planted_dispatch(packed))
    weights = {"layer0.w13": torch.randn(2 * I, H), "layer1.w13": torch.randn(2 * I, H), "layer0.w2": torch.randn(H, I)}
    probes = require_invariant_packed_gemms(weights)
    assert all(probe.invariant for probe in probes.values())
    assert len(packed) == 2  # the two w13 share one shape and dtype: packed and probed once
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", _planted_dispatch(packed, {3}))
    with pytest.raises(BatchVariantShapeError, match=r"layer0\.w2: .*N=16, K=8.*M in \[3\]"):
        require_invariant_packed_gemms({"layer0.w2": torch.randn(H, I)})
