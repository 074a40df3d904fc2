"""The one architecture description both faces build from: what it reads from a config, and
what each face refuses clearly (no engine, no checkpoint: transformers configs only)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from zero_mismatch_plugin.tables.architectures import SUPPORTED_ARCHITECTURES, describe
from zero_mismatch_plugin.faces.megatron.convert import megatron_blocks, transformer_config_from_hf

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=32)


def _config(cls, arch, **extra):
    return cls(architectures=[arch], **SHAPE, **extra)


def test_every_supported_architecture_is_described():
    configs = {
        "LlamaForCausalLM": _config(LlamaConfig, "LlamaForCausalLM"),
        "Qwen2ForCausalLM": _config(Qwen2Config, "Qwen2ForCausalLM"),
        "Qwen3ForCausalLM": _config(Qwen3Config, "Qwen3ForCausalLM", head_dim=32),
    }
    assert set(configs) <= set(SUPPORTED_ARCHITECTURES)
    llama, qwen2, qwen3 = (describe(configs[a]) for a in configs)
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm, llama.head_dim) == (False, False, False, 16)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm, qwen3.head_dim) == (False, False, True, 32)
    assert (llama.norm, llama.attention, llama.mlp, llama.rope_type) == ("rms", "causal", "swiglu", "default")


def test_llama_attention_bias_biases_qkv_and_o_as_vllm_reads_it():
    blocks = describe(_config(LlamaConfig, "LlamaForCausalLM", attention_bias=True))
    assert (blocks.qkv_bias, blocks.o_bias) == (True, True)


def test_megatron_face_refuses_the_o_proj_bias_it_cannot_hold():
    # It used to build a model with q/k/v biases and silently drop the checkpoint's o_proj bias.
    config = _config(LlamaConfig, "LlamaForCausalLM", attention_bias=True)
    with pytest.raises(NotImplementedError, match="o_proj bias .* not supported by the Megatron face"):
        megatron_blocks(config)
    with pytest.raises(NotImplementedError, match="o_proj bias"):
        transformer_config_from_hf(config)


def test_unsupported_architecture_lists_the_supported_ones():
    config = _config(LlamaConfig, "GPT2LMHeadModel")
    with pytest.raises(NotImplementedError, match="'GPT2LMHeadModel' is not supported.*supported: LlamaForCausalLM"):
        describe(config)


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(hidden_act="gelu"), "only SwiGLU"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(layer_types=["sliding_attention"]), "sliding-window layers"),
    ],
)
def test_features_outside_the_blocks_are_refused_by_both_faces(extra, message):
    config = _config(LlamaConfig, "LlamaForCausalLM", **extra)
    with pytest.raises(NotImplementedError, match=message):
        describe(config)
    with pytest.raises(NotImplementedError, match=message):
        megatron_blocks(config)


def test_mistral_is_one_entry_and_its_window_reaches_every_layer_of_both_faces():
    from transformers import MistralConfig

    blocks = describe(_config(MistralConfig, "MistralForCausalLM", sliding_window=None))
    assert (blocks.architecture, blocks.qkv_bias, blocks.o_bias, blocks.qk_norm) == (
        "MistralForCausalLM", False, False, False)
    assert blocks.sliding_windows == () and blocks.window_of(0) is None
    assert megatron_blocks(_config(MistralConfig, "MistralForCausalLM", sliding_window=None)) == blocks
    windowed = _mistral(sliding_window=4096, num_hidden_layers=3)
    assert describe(windowed).sliding_windows == (4096, 4096, 4096)
    assert megatron_blocks(windowed) == describe(windowed)
    config = transformer_config_from_hf(windowed)
    assert config.window_size == (4095, 0) and config.window_attn_skip_freq is None
    scaled = _config(MistralConfig, "MistralForCausalLM", sliding_window=None)
    scaled.llama_4_scaling = {"original_max_position_embeddings": 8192, "beta": 0.1}
    with pytest.raises(NotImplementedError, match="llama_4_scaling"):
        describe(scaled)


@pytest.mark.parametrize(
    "config, message",
    [
        # vLLM's Qwen2/Qwen3 window every layer where transformers windows only the upper ones.
        (lambda: _config(Qwen2Config, "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64,
                         max_window_layers=0), "sliding-window layers"),
        # transformers' Mistral ignores layer_types (every layer windowed); vLLM follows them.
        (lambda: _mistral(sliding_window=64, layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2),
         "sliding-window layers"),
        (lambda: _mistral(sliding_window=0), "sliding_window=0: a positive number"),
    ],
)
def test_windows_read_differently_by_vllm_and_transformers_are_refused(config, message):
    config = config()
    for face in (describe, megatron_blocks):
        with pytest.raises(NotImplementedError, match=message):
            face(config)


def _mistral(**extra):
    from transformers import MistralConfig

    shape = {**SHAPE, **{k: extra.pop(k) for k in list(extra) if k in SHAPE}}
    return MistralConfig(architectures=["MistralForCausalLM"], **shape, **extra)


def test_megatron_window_is_read_per_layer_like_megatron_reads_it():
    from types import SimpleNamespace

    from zero_mismatch_plugin.faces.megatron.convert import vllm_window
    from zero_mismatch_plugin.faces.megatron.modules import _layer_window
    from zero_mismatch_plugin.faces.megatron.spec import unsupported_features

    assert vllm_window((11, 0)) == 12 and vllm_window((11, 3)) is None and vllm_window(4096) is None
    every = SimpleNamespace(window_size=(11, 0), window_attn_skip_freq=None)
    assert [_layer_window(every, n) for n in (1, 2)] == [12, 12]
    mixed = SimpleNamespace(window_size=(11, 0), window_attn_skip_freq=[1, 0, 1])
    assert [_layer_window(mixed, n) for n in (1, 2, 3)] == [12, None, 12]
    assert unsupported_features(SimpleNamespace(window_size=(11, 0))) == []
    assert "sliding-window attention" in unsupported_features(SimpleNamespace(window_size=(11, 5)))[0]


def _cwm(layer_types, sliding_window=64):
    from transformers import CwmConfig

    shape = {**SHAPE, "num_hidden_layers": len(layer_types), "head_dim": 16}
    return CwmConfig(architectures=["CwmForCausalLM"], **shape, sliding_window=sliding_window,
                     layer_types=layer_types, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def test_cwm_layer_types_choose_the_windowed_layers_of_both_faces():
    from zero_mismatch_plugin.faces.megatron.modules import _layer_window

    config = _cwm(["sliding_attention", "full_attention", "full_attention", "sliding_attention"])
    blocks = describe(config)
    assert blocks.sliding_windows == (64, None, None, 64)
    assert [blocks.window_of(i) for i in range(4)] == [64, None, None, 64]
    assert megatron_blocks(config) == blocks
    megatron = transformer_config_from_hf(config)
    assert megatron.window_size == (63, 0) and megatron.window_attn_skip_freq == [1, 0, 0, 1]
    assert [_layer_window(megatron, n) for n in (1, 2, 3, 4)] == [64, None, None, 64]
    # Only full-attention layers: vLLM windows none of them, and neither does either face.
    assert describe(_cwm(["full_attention"] * 2)).sliding_windows == ()


def test_cwm_layer_types_vllm_does_not_read_as_windows_are_refused():
    config = _cwm(["sliding_attention", "chunked_attention"])
    for face in (describe, megatron_blocks):
        with pytest.raises(NotImplementedError, match=r"layer_types \['chunked_attention'\]: only sliding_attention"):
            face(config)
    config = _cwm(["sliding_attention", "full_attention"])
    config.layer_types = ["sliding_attention"]  # after transformers' own check
    with pytest.raises(NotImplementedError, match="1 layer_types for 2 layers: give one per layer"):
        describe(config)


def test_interleaved_windows_of_other_families_name_the_covered_one():
    config = _mistral(sliding_window=64, layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
    with pytest.raises(NotImplementedError, match="interleaved windows are covered for CwmForCausalLM only"):
        describe(config)


def _kimi_linear(**extra):
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    kda = dict(kda_layers=[1, 2], full_attn_layers=[], head_dim=16, num_heads=4, short_conv_kernel_size=4)
    kda.update(extra.pop("kda", {}))
    return KimiLinearConfig(architectures=["KimiLinearForCausalLM"], hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, vocab_size=32, linear_attn_config=kda, **extra)


def test_kimi_linear_is_one_entry_whose_kda_layers_only_the_aligned_model_runs():
    """Kimi Linear's KDA layers (the config counts them from 1), its bf16 add-then-norm ending, and the
    faces that do not run KDA refuse it by name."""
    blocks = describe(_kimi_linear(kda={"gate_lower_bound": -5.0}))
    kda = blocks.linear_attention
    assert (kda.kind, kda.layers, kda.num_heads, kda.head_dim, kda.conv_kernel) == ("kda", (0, 1), 4, 16, 4)
    assert kda.gate_lower_bound == -5.0 and kda.module == "self_attn" and kda.projection_size == 64
    assert blocks.final_add_then_norm and blocks.mixer_kind(1) == "linear"
    assert blocks.aligned_model_only() == "linear attention (Kimi Delta Attention)"
    with pytest.raises(NotImplementedError, match=r"Kimi Delta Attention"):
        megatron_blocks(_kimi_linear())
    assert blocks.moe is None


def test_kimi_moe_layers_are_read_as_vllm_builds_them():
    """Kimi's MoE from first_k_dense_replace on: the grouped sigmoid router with its bias, the routed
    scale on the router's weights (Kimi's layer does not ask vLLM to scale the output), and
    num_shared_experts widths of shared expert, under Kimi's checkpoint names."""
    moe = describe(_kimi_linear(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=2,
                                first_k_dense_replace=1, num_expert_group=2, topk_group=1,
                                routed_scaling_factor=2.5)).moe
    assert (moe.num_experts, moe.top_k, moe.moe_layers, moe.names) == (8, 2, (1,), "kimi")
    assert (moe.scoring_func, moe.grouped_topk, moe.n_group, moe.topk_group) == ("sigmoid", True, 2, 1)
    assert moe.e_score_correction_bias and moe.routed_scale_on_weights and moe.routed_scaling_factor == 2.5
    assert moe.shared_expert_intermediate_size == 64 and moe.norm_topk_prob


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(kda={"kda_layers": [1], "full_attn_layers": [2]}), r"full_attn_layers \[2\]: Kimi's MLA layers"),
        (dict(kda={"use_full_rank_gate": True}), r"use_full_rank_gate"),
        (dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, routed_expert_hidden_size=16),
         r"routed_expert_hidden_size \(Kimi K3's latent MoE"),
        (dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, use_grouped_topk=False),
         r"use_grouped_topk=false"),
        (dict(attn_res_block_size=2), r"attn_res_block_size"),
        (dict(num_nextn_predict_layers=1), r"num_nextn_predict_layers"),
        (dict(hidden_act="situ"), r"hidden_act='situ'"),
    ],
)
def test_kimi_linear_settings_the_aligned_model_does_not_run_are_refused_by_name(extra, message):
    with pytest.raises(NotImplementedError, match=message):
        describe(_kimi_linear(**extra))
