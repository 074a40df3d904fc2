"""The linear-attention layers of hybrid checkpoints in the aligned model: gated delta-net
(Qwen3-Next) and Kimi Delta Attention (Kimi Linear), chosen by the blocks' ``kind``.

Parameters carry the checkpoint's names (gated delta-net: ``linear_attn.in_proj_qkvz``,
``in_proj_ba``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``; KDA:
``self_attn.q_proj`` ... ``o_proj``); the forward is vLLM's layer as the engine runs it in
consistent mode: vLLM's linears around the token mixer of
:mod:`~zero_mismatch_plugin.aligned.linear_attention` or
:mod:`~zero_mismatch_plugin.aligned.kimi_delta_attention`.
"""

from __future__ import annotations

import torch

from zero_mismatch_plugin.aligned.kimi_delta_attention import AlignedKimiDeltaAttention
from zero_mismatch_plugin.aligned.linear_attention import AlignedGatedDeltaNet
from zero_mismatch_plugin.aligned.ops import AlignedLinear
from zero_mismatch_plugin.faces.checkpoint_layout import gated_delta_net_weights, kimi_delta_attention_weights


def linear_attention_weights(hidden_size: int, blocks) -> tuple[str, torch.nn.Module]:
    """(the layer's attribute in the checkpoint, its parameter holders) for ``blocks`` (a
    ``GatedDeltaNetBlocks`` or ``KimiDeltaAttentionBlocks``)."""
    if blocks.kind == "kda":
        return blocks.module, kimi_delta_attention_weights(hidden_size, blocks)
    return blocks.module, gated_delta_net_weights(hidden_size, blocks)


def linear_attention_ops(runtime, layer: torch.nn.Module, blocks, eps: float) -> dict:
    """The ops of one linear-attention layer (``layer``: its parameter holders)."""
    if blocks.kind == "kda":
        return kimi_delta_attention_ops(runtime, layer, blocks)
    return gated_delta_net_ops(runtime, layer, blocks, eps)


def linear_attention_mixer(ops: dict, linear, hidden: torch.Tensor, seq_lens) -> torch.Tensor:
    """The layer's token mixer from its input norm's output to its output projection
    (``linear(name, x)``: the layer's linears), each packed sequence from a zero state."""
    if "kda" in ops:
        return kimi_delta_attention_mixer(ops, linear, hidden, seq_lens)
    return gated_delta_net_mixer(ops, linear, hidden, seq_lens)


def gated_delta_net_ops(runtime, layer: torch.nn.Module, gdn, eps: float) -> dict:
    """The ops of one gated delta-net layer: its three linears (vLLM's merged layouts are the
    checkpoint's own here) and the token mixer between them."""
    return dict(
        in_proj_qkvz=AlignedLinear(runtime, [layer.in_proj_qkvz.weight]),
        in_proj_ba=AlignedLinear(runtime, [layer.in_proj_ba.weight]),
        out_proj=AlignedLinear(runtime, [layer.out_proj.weight]),
        gdn=AlignedGatedDeltaNet(runtime, gdn, layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight, eps),
    )


def gated_delta_net_mixer(ops: dict, linear, hidden: torch.Tensor, seq_lens) -> torch.Tensor:
    """``QwenGatedDeltaNetAttention.forward_cpu``: in_proj_qkvz and in_proj_ba, the mixer over
    each packed sequence from a zero state, out_proj (``linear(name, x)``: the layer's linears)."""
    core = ops["gdn"](linear("in_proj_qkvz", hidden), linear("in_proj_ba", hidden), seq_lens)
    return linear("out_proj", core)


def kimi_delta_attention_ops(runtime, layer: torch.nn.Module, kda) -> dict:
    """The ops of one KDA layer as vLLM's ``KimiGatedDeltaNetAttention`` builds its linears:
    ``in_proj_qkvgfab`` (q, k, v, beta, f_a merged in that order), ``f_b_proj``, ``g_a_proj``,
    ``g_b_proj``, ``o_proj``, and the token mixer."""
    return dict(
        in_proj=AlignedLinear(runtime, [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight,
                                        layer.b_proj.weight, layer.f_a_proj.weight]),
        f_b=AlignedLinear(runtime, [layer.f_b_proj.weight]),
        g_a=AlignedLinear(runtime, [layer.g_a_proj.weight]),
        g_b=AlignedLinear(runtime, [layer.g_b_proj.weight]),
        o=AlignedLinear(runtime, [layer.o_proj.weight]),
        kda=AlignedKimiDeltaAttention(runtime, kda, [layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight],
                                      layer.A_log, layer.dt_bias, layer.o_norm.weight),
    )


def kimi_delta_attention_mixer(ops: dict, linear, hidden: torch.Tensor, seq_lens) -> torch.Tensor:
    """``KimiGatedDeltaNetAttention.forward``: the merged projection split into q/k/v, beta and
    the decay's low-rank input, the decay's and the output gate's second projections, the mixer,
    o_proj."""
    kda = ops["kda"].blocks
    mixed_qkv, raw_beta, f_a = linear("in_proj", hidden).split(
        [3 * kda.projection_size, kda.num_heads, kda.head_dim], dim=-1)
    g2 = linear("g_b", linear("g_a", hidden))  # vLLM's order: the output gate, then the decay
    g1 = linear("f_b", f_a)
    return linear("o", ops["kda"](mixed_qkv, g1, g2, raw_beta, seq_lens))
