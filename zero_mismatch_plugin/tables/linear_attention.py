"""The linear-attention layers of hybrid checkpoints (gated delta-net), as the architectures table
describes them. Light on purpose, like the table: no torch, vLLM or megatron-core."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The linears of a gated delta-net layer a LoRA adapter targets (vLLM wraps all three), under the
# checkpoint's names; the parent module of each in the checkpoint and PEFT's tensor names.
GATED_DELTA_NET_LORA_TARGETS = ("in_proj_qkvz", "in_proj_ba", "out_proj")
LINEAR_ATTENTION_MODULE = "linear_attn"


@dataclass(frozen=True)
class GatedDeltaNetBlocks:
    """Gated delta-net linear attention (Qwen3-Next), as vLLM's ``QwenGatedDeltaNetAttention``
    builds it with the checkpoint's interleaved in_proj_qkvz / in_proj_ba layout."""

    layers: tuple[int, ...]  # the layers whose token mixer is linear attention (the others: full attention)
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the causal conv1d's width over time
    output_gate: str  # the gated output norm's activation on z ("silu" or "sigmoid")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def as_dict(self) -> dict:
        return asdict(self)


def qwen3_next_linear_attention(config) -> GatedDeltaNetBlocks:
    """The linear-attention layers of a Qwen3-Next config (``layer_types``) and their shapes."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    gate = getattr(config, "output_gate_type", "silu")
    return GatedDeltaNetBlocks(
        layers=tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention"),
        num_key_heads=config.linear_num_key_heads,
        num_value_heads=config.linear_num_value_heads,
        key_head_dim=config.linear_key_head_dim,
        value_head_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        output_gate="silu" if gate == "swish" else gate,
    )
