"""The gated delta-net layers of linear-attention hybrids (Qwen3-Next) in the aligned model.

Parameters carry the checkpoint's names (``linear_attn.in_proj_qkvz``, ``in_proj_ba``, ``conv1d``,
``A_log``, ``dt_bias``, ``norm``, ``out_proj``); the forward is vLLM's ``QwenGatedDeltaNetAttention``
as the engine runs it in consistent mode: vLLM's linears, then
:class:`~zero_mismatch_plugin.aligned.linear_attention.AlignedGatedDeltaNet`.
"""

from __future__ import annotations

import torch

from zero_mismatch_plugin.aligned.linear_attention import AlignedGatedDeltaNet
from zero_mismatch_plugin.aligned.ops import AlignedLinear


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
