"""The patches that let verl's Megatron engine build and train on the CPU platform: what each CPU
form computes, checked against what the original computes or refuses (the whole engine runs in
test_main_ppo_megatron.py)."""

from __future__ import annotations

import pytest
import torch

from zero_mismatch_plugin.integrations.megatron import cpu_patches
from zero_mismatch_plugin.integrations.verl.cpu import mcore_engine, patches


def test_megatron_engine_config_admits_fp32_only_with_the_patch():
    from verl.workers.config.engine import McoreEngineConfig

    with pytest.raises(AssertionError, match="dtype float32 not supported"):
        McoreEngineConfig(dtype="float32")
    with patches.config_checks_applied():
        assert McoreEngineConfig(dtype="float32").dtype == "float32"
        # The rest of verl's checks still run.
        with pytest.raises(AssertionError):
            McoreEngineConfig(dtype="float32", strategy="fsdp")
    with pytest.raises(AssertionError, match="dtype float32 not supported"):
        McoreEngineConfig(dtype="float32")


@pytest.mark.parametrize("local, fused", [
    ("decoder.layers.3.input_layernorm.weight", "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"),
    ("decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"),
    ("decoder.layers.1.mlp.router.weight", None),
    ("decoder.layers.1.self_attention.linear_qkv.weight", None),
])
def test_local_norm_names_are_asked_under_transformer_engines_names(local, fused):
    assert mcore_engine.transformer_engine_name(local) == fused


def test_local_experts_take_grouped_names_with_this_expert_parallel_ranks_global_index():
    """mbridge's local-to-global map: layer numbers as the original gives them; local experts under
    grouped-GEMM names, offset to global experts only where the original offsets grouped ones."""
    from types import SimpleNamespace

    local = {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight":
             "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight",
             "decoder.layers.0.mlp.router.weight": "decoder.layers.2.mlp.router.weight"}
    mapping = mcore_engine.local_experts_as_grouped(lambda self, model, consider_ep: dict(local))
    bridge = SimpleNamespace(config=SimpleNamespace(num_moe_experts=8), mpu=SimpleNamespace(ep_size=2, ep_rank=1))
    assert mapping(bridge, None) == {
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight": "decoder.layers.2.mlp.experts.linear_fc1.weight5",
        "decoder.layers.0.mlp.router.weight": "decoder.layers.2.mlp.router.weight"}
    assert mapping(bridge, None, consider_ep=False)[
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"] == "decoder.layers.2.mlp.experts.linear_fc1.weight1"
    assert mcore_engine.grouped_expert_name("decoder.layers.1.mlp.experts.local_experts.12.linear_fc2.weight") == (
        "decoder.layers.1.mlp.experts.linear_fc2.weight12")


def test_a_name_mbridge_knows_is_not_renamed_and_an_unknown_one_still_raises():
    asked = []

    def mapping(self, name):
        asked.append(name)
        if name.endswith("layer_norm_weight") or name.endswith("router.weight"):
            return [f"hf:{name}"]
        raise NotImplementedError(f"Unsupported parameter name: {name}")

    renaming = mcore_engine.local_norm_names_as_fused(mapping)
    assert renaming(None, "decoder.layers.0.mlp.router.weight") == ["hf:decoder.layers.0.mlp.router.weight"]
    assert renaming(None, "decoder.layers.0.input_layernorm.weight") == [
        "hf:decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    with pytest.raises(NotImplementedError, match="decoder.layers.0.mlp.unknown.weight"):
        renaming(None, "decoder.layers.0.mlp.unknown.weight")


def test_packed_mask_lets_each_token_see_its_own_sequence_up_to_itself():
    visible = ~cpu_patches.packed_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 6)[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for start, end in ((0, 2), (2, 5), (5, 6)):  # the token past the last boundary is padding: alone
        for query in range(start, end):
            expected[query, start:query + 1] = True
    assert torch.equal(visible, expected)


def test_packed_local_attention_equals_megatrons_local_attention_on_each_sequence_alone():
    """The THD batch through the patched local attention gives each sequence what the stock local
    attention gives it as a batch of one (with megatron's causal mask)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from zero_mismatch_plugin.integrations.megatron.standalone import cpu_stock_megatron, init_single_process

    init_single_process()
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, masked_softmax_fusion=False, attention_dropout=0.0)
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self")
    packed = cpu_patches._packed_local_attention(DotProductAttention.forward)
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 5]
    q, k, v = (torch.randn(sum(lengths), heads, 4, generator=generator) for heads in (4, 2, 2))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    with cpu_stock_megatron():  # megatron's dropout RNG fork on a CPU
        out = packed(attention, q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        for start, end in ((0, 3), (3, 8)):
            causal = torch.ones(end - start, end - start, dtype=torch.bool).triu(1)[None, None]  # megatron's default
            alone = attention(q[start:end, None], k[start:end, None], v[start:end, None], causal,
                              attn_mask_type=AttnMaskType.causal)
            assert torch.equal(out[start:end], alone)
    with pytest.raises(AssertionError, match="Packed sequence is not supported"):
        DotProductAttention.forward(attention, q, k, v, None, packed_seq_params=params)


def test_host_rng_tracker_forks_named_states_of_the_host_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = cpu_patches._host_rng_tracker(CudaRNGStatesTracker)()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(7)
    outside = torch.rand(3)
    torch.manual_seed(7)
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), outside)  # the host's own stream is where it was
    with tracker.fork():
        second = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # the named stream continues
    with pytest.raises(Exception, match="already exists"):
        tracker.add("model-parallel-rng", 99)


def test_host_torch_sends_cuda_placements_to_the_host():
    host = cpu_patches.host_torch(torch)
    assert host.tensor([1.0], device="cuda").device.type == "cpu"
    assert host.zeros(2, device="cuda:0").device.type == "cpu"
    assert host.empty(2, device=host.cuda.current_device()).device.type == "cpu"
    assert host.float32 is torch.float32 and host.cuda.synchronize() is None


def test_gradient_clip_on_host_scales_as_megatrons_local_path():
    from megatron.core.utils import local_multi_tensor_scale

    parameters = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p, scale in zip(parameters, (3.0, 4.0)):
        p.grad = torch.full_like(p, scale)
    expected = [p.grad.clone() for p in parameters]
    local_multi_tensor_scale(None, None, [expected, expected], 1.0 / (10.0 + 1.0e-6))
    clip = cpu_patches._clip_on_host(lambda *a: pytest.fail("the CUDA path ran"))
    clip(parameters, max_norm=1.0, total_norm=10.0)
    assert all(torch.equal(p.grad, e) for p, e in zip(parameters, expected))
    clip(parameters, max_norm=100.0, total_norm=10.0)  # under the bound: untouched
    assert all(torch.equal(p.grad, e) for p, e in zip(parameters, expected))


@pytest.fixture
def optimizer_host_tensors():
    """megatron's optimizer module with its "cuda" placements on the host (as on the CPU platform)."""
    from zero_mismatch_plugin.integrations import patches as runtime_patches

    was_applied = runtime_patches.is_applied(cpu_patches.OPTIMIZER_HOST_TENSORS)
    runtime_patches.apply(cpu_patches.OPTIMIZER_HOST_TENSORS)
    yield
    if not was_applied:
        runtime_patches.remove(cpu_patches.OPTIMIZER_HOST_TENSORS)


def test_float16_optimizer_on_host_keeps_fp32_masters_of_bf16_parameters_as_megatrons_cuda_path(
        optimizer_host_tensors):
    """megatron's mixed-precision optimizer with host parameters: the original's CUDA type names
    refuse a host bf16 parameter; the host form keeps an fp32 master copy (what the inner optimizer
    steps, its optimizer state moved to it), leaves fp32 parameters as they are, and refuses others."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    def optimizer_of(*params):
        inner = torch.optim.Adam(params, lr=0.1)
        return inner, OptimizerConfig(bf16=True, params_dtype=torch.bfloat16), None, lambda *_: None

    bf16 = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    fp32 = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(TypeError, match="torch.cuda.BFloat16Tensor. Received torch.BFloat16Tensor"):
        Float16OptimizerWithFloat16Params(*optimizer_of(bf16, fp32))
    host_init = cpu_patches._float16_params_on_host(lambda *a: pytest.fail("the CUDA path ran"))
    optimizer = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    inner, config, scaler, init_state = optimizer_of(bf16, fp32)
    host_init(optimizer, inner, config, scaler, init_state)
    (main,) = optimizer.fp32_from_float16_groups[0]
    assert optimizer.float16_groups == [[bf16]] and optimizer.fp32_from_fp32_groups == [[fp32]]
    assert main.dtype == torch.float32 and torch.equal(main, bf16.float()) and bf16.main_param is main
    assert inner.param_groups[0]["params"] == [main, fp32]
    refused = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32 parameters, not torch.float64"):
        host_init(refused, *optimizer_of(torch.nn.Parameter(torch.randn(2, dtype=torch.float64))))
