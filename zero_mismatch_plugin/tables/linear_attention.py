"""The linear-attention layers of hybrid checkpoints (gated delta-net; Kimi Delta Attention), as the
architectures table describes them. Light on purpose, like the table: no torch, vLLM or megatron-core."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The linears of a gated delta-net layer a LoRA adapter targets (vLLM wraps all three), under the
# checkpoint's names; the parent module of each in the checkpoint and PEFT's tensor names.
GATED_DELTA_NET_LORA_TARGETS = ("in_proj_qkvz", "in_proj_ba", "out_proj")
LINEAR_ATTENTION_MODULE = "linear_attn"
# The linears of a Kimi Delta Attention layer a LoRA adapter targets (vLLM wraps them all: q/k/v,
# beta and the decay's f_a merged in in_proj_qkvgfab), under the checkpoint's names in ``self_attn``.
KDA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "o_proj")


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

    kind = "gated_delta_net"
    title = "gated delta-net"  # for messages
    module = LINEAR_ATTENTION_MODULE  # the layer's attribute in the checkpoint

    def as_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


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


# vLLM builds KDA's output norm (FusedRMSNormGated) with its default eps, not the config's.
KDA_OUTPUT_NORM_EPS = 1e-5


@dataclass(frozen=True)
class KimiDeltaAttentionBlocks:
    """Kimi Delta Attention (Kimi Linear), as vLLM's ``KimiGatedDeltaNetAttention`` builds it with
    the low-rank gate (``f_a_proj`` / ``f_b_proj`` for the decay, ``g_a_proj`` / ``g_b_proj`` for
    the output gate); the checkpoint names the layer ``self_attn``."""

    layers: tuple[int, ...]  # the KDA layers (0-based; the config's kda_layers count from 1)
    num_heads: int
    head_dim: int  # keys and values alike
    conv_kernel: int
    gate_lower_bound: float | None  # the "safe gate" form of the decay when set
    norm_eps: float = KDA_OUTPUT_NORM_EPS

    kind = "kda"
    title = "Kimi Delta Attention"  # for messages
    module = "self_attn"

    @property
    def projection_size(self) -> int:
        return self.num_heads * self.head_dim

    def as_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}


def qwen3_next_refusals(config) -> list[str]:
    """What of a Qwen3-Next config (its MoE aside) the aligned model does not run."""
    out = []
    kinds = set(getattr(config, "layer_types", None) or [])
    if not kinds or not kinds <= {"linear_attention", "full_attention"}:
        out.append(f"layer_types {sorted(kinds)}: expected 'linear_attention' and 'full_attention' entries")
    if getattr(config, "layer_scale", False):
        out.append("layer_scale (per-layer output scales): set it to false")
    if getattr(config, "attn_output_gate", True) is not True:
        out.append("attn_output_gate=false: only Qwen3-Next's gated attention output is covered")
    if getattr(config, "dual_chunk_attention_config", None):
        out.append("dual_chunk_attention_config: set it to null")
    if getattr(config, "linear_value_head_dim", 0) != 128 or getattr(config, "linear_key_head_dim", 0) != 128:
        out.append("linear_key_head_dim / linear_value_head_dim other than 128: vLLM's CPU gated delta-net "
                   "kernels run head dim 128 only")
    return out
