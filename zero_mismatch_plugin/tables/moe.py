"""The Mixture-of-Experts MLP of a checkpoint as the architectures table describes it (its own
module so that the families' readers, e.g. :mod:`.kimi_linear`, build it without importing the
table). Light on purpose: no torch, vLLM or megatron-core."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MoeBlocks:
    """The Mixture-of-Experts MLP of a checkpoint, as vLLM's model code configures its layer."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # vLLM's ``renormalize``: the top-k weights sum to one
    moe_layers: tuple[int, ...]  # the layers whose MLP is the MoE; the others are dense SwiGLU
    names: str  # checkpoint naming, a key of architectures.MOE_CHECKPOINT_NAMES
    # The router; the defaults are the plain softmax top-k router.
    scoring_func: str = "softmax"  # "softmax" or "sigmoid" over the router logits
    grouped_topk: bool = False  # DeepSeek-V3 style: experts in n_group groups, topk_group groups kept
    n_group: int | None = None
    topk_group: int | None = None
    e_score_correction_bias: bool = False  # a per-expert bias steering the selection only
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # a sigmoid gate (a 1-row linear) on the shared expert's output
    # Where vLLM's layer applies routed_scaling_factor under grouped routing: on the routed output
    # (DeepSeek-V3, GLM-4.5) or, as Kimi's layer leaves it, on the router's top-k weights.
    routed_scale_on_weights: bool = False

    def as_dict(self) -> dict:
        return asdict(self)
