"""A LoRA target's trainable A and B, and the (out, in) shape of every target of a model."""

from __future__ import annotations

import torch
from torch import nn

from zero_mismatch_plugin.aligned.lora.names import ATTENTION_TARGETS
from zero_mismatch_plugin.tables.architectures import MOE_CHECKPOINT_NAMES, describe
from zero_mismatch_plugin.tables.linear_attention import GATED_DELTA_NET_LORA_TARGETS, KDA_LORA_TARGETS


class LoRAPair(nn.Module):
    """The adapter of one target: ``lora_A`` [r, in] and ``lora_B`` [out, r] (PEFT's layout)."""

    def __init__(self, r: int, in_features: int, out_features: int):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(r, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))


def target_shapes(config, head_dim: int) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every LoRA target of a decoder layer (dense or MLA attention;
    a linear-attention hybrid's attention layers and gated delta-net layers together)."""
    h, inter = config.hidden_size, config.intermediate_size
    if getattr(config, "kv_lora_rank", None) is not None:
        return _mla_target_shapes(config)
    blocks = describe(config)
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    shapes = dict(
        # A gated attention output: q_proj's rows hold each head's query and its gate.
        q_proj=(q * (2 if blocks.attention_output_gate else 1), h), k_proj=(kv, h), v_proj=(kv, h), o_proj=(h, q),
        gate_proj=(inter, h), up_proj=(inter, h), down_proj=(h, inter),
    )
    gdn = blocks.linear_attention
    if gdn is not None and gdn.kind == "kda":
        size, dim = gdn.projection_size, gdn.head_dim
        shapes.update(q_proj=(size, h), k_proj=(size, h), v_proj=(size, h), o_proj=(h, size), b_proj=(gdn.num_heads, h),
                      f_a_proj=(dim, h), f_b_proj=(size, dim), g_a_proj=(dim, h), g_b_proj=(size, dim))
    elif gdn is not None:
        shapes.update(in_proj_qkvz=(2 * gdn.key_dim + 2 * gdn.value_dim, h),
                      in_proj_ba=(2 * gdn.num_value_heads, h), out_proj=(h, gdn.value_dim))
    return shapes


def layer_has_target(blocks, layer: int, target: str) -> bool:
    """Whether decoder layer ``layer`` holds ``target``: in a linear-attention hybrid the gated
    delta-net linears are on its linear-attention layers, q/k/v/o on the others."""
    if blocks.linear_attention is None or target not in GATED_DELTA_NET_LORA_TARGETS + ATTENTION_TARGETS:
        return True
    if blocks.linear_attention.kind == "kda":  # every layer is KDA (Kimi's MLA layers are refused)
        return target in KDA_LORA_TARGETS
    return (blocks.mixer_kind(layer) == "linear") == (target in GATED_DELTA_NET_LORA_TARGETS)


def _mla_target_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every LoRA target of an MLA decoder layer with a dense MLP."""
    h, heads = config.hidden_size, config.num_attention_heads
    q = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    shapes = dict(
        kv_a_proj_with_mqa=(config.kv_lora_rank + config.qk_rope_head_dim, h),
        o_proj=(h, heads * config.v_head_dim),
        gate_proj=(config.intermediate_size, h), up_proj=(config.intermediate_size, h),
        down_proj=(h, config.intermediate_size),
    )
    if getattr(config, "q_lora_rank", None) is None:
        shapes.update(q_proj=(q, h))
    else:
        shapes.update(q_a_proj=(config.q_lora_rank, h), q_b_proj=(q, config.q_lora_rank))
    return shapes


def routed_expert_layers(model_config) -> tuple[dict[int, int], dict[str, tuple[int, int]], str | None, dict]:
    """({MoE layer: number of routed experts}, {target: (out, in)} of one routed expert, the
    checkpoint's name of the shared expert module or None, {target: (out, in)} of the shared
    expert); empty for a dense model."""
    blocks = describe(model_config)
    if blocks.moe is None:
        return {}, {}, None, {}
    moe, h = blocks.moe, model_config.hidden_size
    layers = {i: moe.num_experts for i in range(model_config.num_hidden_layers) if blocks.mlp_kind(i) == "moe"}
    shared_name = MOE_CHECKPOINT_NAMES[moe.names][3] if moe.shared_expert_intermediate_size else None
    width, shared = moe.moe_intermediate_size, moe.shared_expert_intermediate_size
    return (layers, dict(gate_proj=(width, h), up_proj=(width, h), down_proj=(h, width)), shared_name,
            dict(gate_proj=(shared, h), up_proj=(shared, h), down_proj=(h, shared)) if shared_name else {})
