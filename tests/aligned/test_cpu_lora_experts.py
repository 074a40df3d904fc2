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


def _expert_rows_lora_op(w13, w2, adapters):
    """An expert-parallel rank's LoRA experts op, as the Megatron face's MoE layer builds and keeps
    it (megatron's per-expert fc1 [gate; up] and fc2 weights, frozen; the adapters trainable)."""
    from types import SimpleNamespace

    from zero_mismatch_plugin.aligned.expert_parallel import AlignedExpertRowsLoRA

    runtime = SimpleNamespace(vllm_config=SimpleNamespace(
        lora_config=SimpleNamespace(max_lora_rank=8, lora_dtype=torch.float32)))
    return AlignedExpertRowsLoRA(runtime, list(w13), list(w2), adapters, SimpleNamespace(r=R, scaling=2.0))


def test_the_expert_parallel_lora_op_packs_once_and_again_only_what_a_write_changed(dispatches):
    """Forward after forward, the op reuses what it packed: each expert's base linear until that
    weight is written (a reload), the adapter's stacked A/B and their packed linears until one of
    them is (an optimizer step), everything again at refresh (after writes through ``.data``); the
    output is what packing afresh gives."""
    from zero_mismatch_plugin.aligned.lora.targets import LoRAPair

    x, w13, w2, weights, ids = _moe()
    gen = torch.Generator().manual_seed(3)
    # Each expert's weights their own tensors, as megatron's experts hold them (views of one
    # buffer share its write count: a write to one would repack them all, as it should).
    w13 = [torch.nn.Parameter(w.clone(), requires_grad=False) for w in w13]
    w2 = [torch.nn.Parameter(w.clone(), requires_grad=False) for w in w2]
    adapters = []
    for _ in range(E):
        pairs = {"gate_proj": LoRAPair(R, H, I), "up_proj": LoRAPair(R, H, I), "down_proj": LoRAPair(R, I, H)}
        for pair in pairs.values():
            with torch.no_grad():
                pair.lora_A.copy_(torch.randn(pair.lora_A.shape, generator=gen))
                pair.lora_B.copy_(torch.randn(pair.lora_B.shape, generator=gen))
        adapters.append(pairs)
    rows = (x.repeat_interleave(2, 0), weights.reshape(-1), ids.reshape(-1))  # dispatched (token, slot) rows

    op = _expert_rows_lora_op(w13, w2, adapters)
    first = op.rows(*rows)
    packed_first = len(dispatches)
    assert packed_first > 2 * E  # the base linears and the adapter's
    again = op.rows(*rows)
    assert len(dispatches) == packed_first and torch.equal(again, first)

    with torch.no_grad():  # an optimizer step on one adapter matrix
        adapters[1]["down_proj"].lora_B.add_(0.5)
    stepped = op.rows(*rows)
    lora_packs = packed_first - 2 * E
    assert len(dispatches) == packed_first + lora_packs  # the adapter's again, no base weight's
    assert not torch.equal(stepped, first)

    with torch.no_grad():  # a reload writes one expert's down weight
        w2[2].mul_(1.5)
    reloaded = op.rows(*rows)
    assert len(dispatches) == packed_first + lora_packs + 1
    w13[0].data.mul_(1.0)  # a write through .data, which the weights' write counts do not see
    op.refresh()
    assert torch.equal(op.rows(*rows), reloaded)
    assert len(dispatches) == 2 * packed_first + lora_packs + 1  # everything packed again

    # What the kept packings give is what packing everything afresh gives.
    fresh = _expert_rows_lora_op([w.clone() for w in w13], [w.clone() for w in w2],
                                 [{k: _copied(p) for k, p in a.items()} for a in adapters]).rows(*rows)
    assert torch.equal(reloaded, fresh)


def _copied(pair):
    from zero_mismatch_plugin.aligned.lora.targets import LoRAPair

    copy = LoRAPair(pair.lora_A.shape[0], pair.lora_A.shape[1], pair.lora_B.shape[0])
    with torch.no_grad():
        copy.lora_A.copy_(pair.lora_A)
        copy.lora_B.copy_(pair.lora_B)
    return copy
