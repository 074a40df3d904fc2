"""The aligned model's parameter holders, named like the checkpoint's modules, so that the
trainer's ``named_parameters()`` are the checkpoint's names: dense and MoE MLPs, multi-head
latent attention's projections, gated delta-net and Kimi Delta Attention layers."""

from __future__ import annotations

import torch
from torch import nn

from zero_mismatch_plugin.tables.architectures import MOE_CHECKPOINT_NAMES


class Weights(nn.Module):
    """A parameter holder named like the checkpoint's module (``weight`` [+ ``bias``])."""

    def __init__(self, shape, bias_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))
        self.bias = nn.Parameter(torch.empty(bias_size)) if bias_size else None


def swiglu(h: int, inter: int) -> nn.Module:
    """gate_proj, up_proj, down_proj of one SwiGLU MLP (checkpoint names)."""
    mlp = nn.Module()
    mlp.gate_proj = Weights((inter, h))
    mlp.up_proj = Weights((inter, h))
    mlp.down_proj = Weights((h, inter))
    return mlp


def moe_block(h: int, moe) -> tuple[str, nn.Module]:
    block_name, gate_name, (g, u, d), shared_name = MOE_CHECKPOINT_NAMES[moe.names]
    block = nn.Module()
    gate = Weights((moe.num_experts, h))
    if moe.e_score_correction_bias:
        # Steers the selection only: no gradient; a parameter so that it is saved and synced.
        gate.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)
    setattr(block, gate_name, gate)
    experts = nn.ModuleList()
    for _ in range(moe.num_experts):
        expert = nn.Module()
        setattr(expert, g, Weights((moe.moe_intermediate_size, h)))
        setattr(expert, u, Weights((moe.moe_intermediate_size, h)))
        setattr(expert, d, Weights((h, moe.moe_intermediate_size)))
        experts.append(expert)
    block.experts = experts
    if moe.shared_expert_intermediate_size:
        setattr(block, shared_name, swiglu(h, moe.shared_expert_intermediate_size))
        if moe.shared_expert_gate:
            block.shared_expert_gate = Weights((1, h))
    return block_name, block


def mla_projections(h: int, nh: int, mla) -> nn.Module:
    """The projections of one multi-head latent attention (DeepSeek-V2/V3 checkpoint names)."""
    attn = nn.Module()
    if mla.q_lora_rank is None:
        attn.q_proj = Weights((nh * mla.qk_head_dim, h))
    else:
        attn.q_a_proj = Weights((mla.q_lora_rank, h))
        attn.q_a_layernorm = Weights((mla.q_lora_rank,))
        attn.q_b_proj = Weights((nh * mla.qk_head_dim, mla.q_lora_rank))
    attn.kv_a_proj_with_mqa = Weights((mla.kv_lora_rank + mla.qk_rope_head_dim, h))
    attn.kv_a_layernorm = Weights((mla.kv_lora_rank,))
    attn.kv_b_proj = Weights((nh * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
    attn.o_proj = Weights((h, nh * mla.v_head_dim))
    return attn


def gated_delta_net_weights(hidden_size: int, gdn) -> nn.Module:
    """The parameters of one gated delta-net layer (``gdn``: its ``GatedDeltaNetBlocks``)."""
    layer = nn.Module()
    layer.in_proj_qkvz = Weights((2 * gdn.key_dim + 2 * gdn.value_dim, hidden_size))
    layer.in_proj_ba = Weights((2 * gdn.num_value_heads, hidden_size))
    layer.conv1d = Weights((2 * gdn.key_dim + gdn.value_dim, 1, gdn.conv_kernel))
    layer.A_log = nn.Parameter(torch.empty(gdn.num_value_heads))
    layer.dt_bias = nn.Parameter(torch.empty(gdn.num_value_heads))
    layer.norm = Weights((gdn.value_head_dim,))
    layer.out_proj = Weights((hidden_size, gdn.value_dim))
    return layer


def kimi_delta_attention_weights(hidden_size: int, kda) -> nn.Module:
    """The parameters of one Kimi Delta Attention layer under the checkpoint's names (``kda``: its
    ``KimiDeltaAttentionBlocks``): q/k/v with their short convs, beta, the decay's and the output
    gate's low-rank pairs, A_log, dt_bias, the output norm and o_proj."""
    layer, size, dim = nn.Module(), kda.projection_size, kda.head_dim
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(layer, name, Weights((size, hidden_size)))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        setattr(layer, name, Weights((size, 1, kda.conv_kernel)))
    layer.b_proj = Weights((kda.num_heads, hidden_size))
    layer.f_a_proj = Weights((dim, hidden_size))
    layer.f_b_proj = Weights((size, dim))
    layer.g_a_proj = Weights((dim, hidden_size))
    layer.g_b_proj = Weights((size, dim))
    layer.A_log = nn.Parameter(torch.empty(kda.num_heads))
    layer.dt_bias = nn.Parameter(torch.empty(size))
    layer.o_norm = Weights((dim,))
    layer.o_proj = Weights((hidden_size, size))
    return layer
