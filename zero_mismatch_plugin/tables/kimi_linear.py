"""What the architectures table reads from a Kimi Linear config (vLLM's ``KimiLinearForCausalLM``):
its Kimi Delta Attention layers, its Mixture-of-Experts MLPs, and what the aligned model refuses.
Light on purpose, like the table: no torch, vLLM or megatron-core."""

from __future__ import annotations

from zero_mismatch_plugin.tables.linear_attention import KimiDeltaAttentionBlocks
from zero_mismatch_plugin.tables.moe import MoeBlocks


def kimi_linear_attention(config) -> KimiDeltaAttentionBlocks:
    """The KDA layers of a Kimi Linear config (``linear_attn_config``) and their shapes."""
    kda = getattr(config, "linear_attn_config", None) or {}
    return KimiDeltaAttentionBlocks(
        layers=tuple(i for i in range(config.num_hidden_layers) if i + 1 in (kda.get("kda_layers") or ())),
        num_heads=kda["num_heads"],
        head_dim=kda["head_dim"],
        conv_kernel=kda["short_conv_kernel_size"],
        gate_lower_bound=kda.get("gate_lower_bound"),
    )


def kimi_moe(config) -> MoeBlocks | None:
    """The Mixture-of-Experts MLP of a Kimi Linear config (a ``MoeBlocks``), None without experts:
    vLLM's KimiMoE, from first_k_dense_replace on, every moe_layer_freq-th layer; the grouped
    (DeepSeek-V3 style) router with its correction bias, the routed scale, and num_shared_experts
    widths of shared expert."""
    if getattr(config, "num_experts", None) is None:
        return None
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    n_shared = int(getattr(config, "num_shared_experts", 0) or 0)
    return MoeBlocks(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_token,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(config.moe_renormalize),
        scoring_func=config.moe_router_activation_func,
        grouped_topk=True,
        n_group=config.num_expert_group,
        topk_group=config.topk_group,
        e_score_correction_bias=True,
        routed_scaling_factor=float(config.routed_scaling_factor),
        routed_scale_on_weights=True,  # KimiMoE passes no apply_routed_scale_to_output
        shared_expert_intermediate_size=config.moe_intermediate_size * n_shared,
        moe_layers=tuple(i for i in range(config.num_hidden_layers) if i >= first_dense and i % freq == 0),
        names="kimi",
    )


def kimi_linear_refusals(config) -> list[str]:
    """What of a Kimi Linear config the aligned model does not run: it covers the KDA layers with
    the low-rank gate, dense SwiGLU MLPs and Kimi's MoE layers (grouped router, shared experts)."""
    kda = getattr(config, "linear_attn_config", None)
    if not kda:
        return ["linear_attn_config unset: a Kimi Linear checkpoint names its KDA layers there"]
    out = []
    if kda.get("full_attn_layers"):
        out.append(f"full_attn_layers {list(kda['full_attn_layers'])}: Kimi's MLA layers are not covered on CPU "
                   "(vLLM's Kimi MLA needs a CUDA-only fused cache insert); give every layer to kda_layers")
    if kda.get("use_full_rank_gate"):
        out.append("use_full_rank_gate (Kimi K3's full-rank KDA gate): not covered; the low-rank gate is")
    if getattr(config, "num_experts", None) is not None:
        if getattr(config, "routed_expert_hidden_size", None) is not None:
            out.append("routed_expert_hidden_size (Kimi K3's latent MoE projections): set it to null")
        if not getattr(config, "use_grouped_topk", True):
            out.append("use_grouped_topk=false: Kimi's grouped router (num_expert_group / topk_group) is covered")
    if getattr(config, "attn_res_block_size", None) is not None:
        out.append("attn_res_block_size (attention residual blocks): set it to null")
    if getattr(config, "num_nextn_predict_layers", 0):
        out.append("num_nextn_predict_layers (multi-token prediction layers): set it to 0")
    return out
