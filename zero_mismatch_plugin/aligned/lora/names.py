"""The modules a LoRA adapter targets, and PEFT's names of its tensors.

Which targets the aligned path adapts on a model (:func:`supported_lora_targets`), the merged
linears of the aligned model they are stacked in, and PEFT's tensor names of decoder-layer,
routed-expert, shared-expert and vocabulary adapters (see ``docs/lora.md``).
"""

from __future__ import annotations

import re

from zero_mismatch_plugin.tables.architectures import LORA_TARGETS as ALIGNED_LORA_TARGETS
from zero_mismatch_plugin.tables.architectures import HYBRID_ARCHITECTURES, MLA_LORA_TARGETS, MOE_CHECKPOINT_NAMES
from zero_mismatch_plugin.tables.architectures import VOCAB_LORA_ARCHITECTURES, VOCAB_LORA_TARGETS
from zero_mismatch_plugin.tables.linear_attention import GATED_DELTA_NET_LORA_TARGETS, KDA_LORA_TARGETS
from zero_mismatch_plugin.tables.linear_attention import LINEAR_ATTENTION_MODULE

ATTENTION_TARGETS = ALIGNED_LORA_TARGETS[:4]
MLP_TARGETS = ALIGNED_LORA_TARGETS[4:]

# The merged linears of the aligned model and the checkpoint modules stacked in them, in order.
MERGED_TARGETS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# A linear-attention hybrid's: the above on its attention and MLP layers, and each gated delta-net
# layer's three linears, each its own (vLLM's in_proj_qkvz is one merged slice).
HYBRID_MERGED_TARGETS = {**MERGED_TARGETS, **{t: (t,) for t in GATED_DELTA_NET_LORA_TARGETS}}
# A Kimi Delta Attention model's: vLLM's in_proj_qkvgfab (q, k, v, beta, the decay's f_a), the
# decay's and the output gate's other projections, o_proj, and the dense MLP.
KDA_MERGED_TARGETS = {"in_proj": KDA_LORA_TARGETS[:5], **{t.removesuffix("_proj"): (t,) for t in KDA_LORA_TARGETS[5:8]},
                      "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp|linear_attn)\.(\w+)\.lora_(A|B)\.weight$"
)
# Multi-head latent attention (DeepSeek-V2/V3): the linears of the aligned model's MLA layer and the
# checkpoint modules vLLM adapts in each (its fused_qkv_a_proj: q_a_proj and kv_a_proj_with_mqa).
MLA_ATTENTION_TARGETS = tuple(t for t in MLA_LORA_TARGETS if t not in MLP_TARGETS)
_MLA_COMMON = {"o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MLA_MERGED_TARGETS = {"q": ("q_proj",), "kv_a": ("kv_a_proj_with_mqa",), **_MLA_COMMON}
MLA_Q_LORA_MERGED_TARGETS = {"qkv_a": ("q_a_proj", "kv_a_proj_with_mqa"), "q": ("q_b_proj",), **_MLA_COMMON}

# PEFT's names of the vocabulary adapters (an embedding's A and B are PEFT parameters, not Linears).
PEFT_VOCAB_NAMES = {
    "embed_tokens": ("base_model.model.model.embed_tokens.lora_embedding_A",
                     "base_model.model.model.embed_tokens.lora_embedding_B"),
    "lm_head": ("base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"),
}
_PEFT_VOCAB_TENSORS = {n for names in PEFT_VOCAB_NAMES.values() for n in names}

# The decoder-layer module (``self_attn`` or ``mlp``) holding each target.
PARENT_MODULE = {
    **{t: "self_attn" for t in ATTENTION_TARGETS + MLA_ATTENTION_TARGETS},
    **{t: "mlp" for t in MLP_TARGETS},
    **{t: LINEAR_ATTENTION_MODULE for t in GATED_DELTA_NET_LORA_TARGETS},
    **{t: "self_attn" for t in KDA_LORA_TARGETS},
}

# The MLP targets, in a Mixture-of-Experts layer those of each routed expert: vLLM loads them as
# per-expert modules (``mlp.experts.{e}.gate_proj`` ...) and serves the three together; and of the
# shared expert, if the layer has one (a dense SwiGLU: vLLM's dense LoRA layers).
EXPERT_TARGETS = MLP_TARGETS
_EXPERT_MODULE_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.(experts\.\d+|shared_experts?)\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.lora_(A|B)\.weight$"
)
# Every checkpoint's name of an expert linear -> its EXPERT_TARGETS name (Mixtral's w1 -> gate_proj ...).
_CHECKPOINT_EXPERT_TARGET = {name: target for names in MOE_CHECKPOINT_NAMES.values()
                             for name, target in zip(names[2], EXPERT_TARGETS)}

# The fused expert parameters PEFT adapts (a 3-D expert adapter, ``target_parameters``) and the
# module of each one's A and B in the adapter's tensor names: PEFT nests gate_up_proj's inside
# whatever the order of target_parameters (a set to PEFT: its written order changes with the hash
# seed, the nesting does not); vLLM reads ``base_layer`` as gate_up_proj's.
FUSED_EXPERT_MODULES = {"gate_up_proj": "mlp.experts.base_layer", "down_proj": "mlp.experts"}


def supported_lora_targets(model_config, vocab: bool = False) -> tuple[str, ...]:
    """The checkpoint modules the aligned LoRA path adapts for this model: the dense linears, or
    for multi-head latent attention the projections vLLM applies an adapter to on every token
    (``q_proj`` without, ``q_a_proj`` / ``q_b_proj`` with a query low-rank projection). With
    ``vocab`` (the aligned model face) also ``embed_tokens`` / ``lm_head`` for the architectures
    whose engine adapts them (``VOCAB_LORA_ARCHITECTURES``)."""
    if getattr(model_config, "kv_lora_rank", None) is None:
        architecture = (getattr(model_config, "architectures", None) or [None])[0]
        if architecture in HYBRID_ARCHITECTURES and _linear_attention_kind(model_config) == "kda":
            # Every KDA projection, the dense MLP's and (MoE layers) the routed and shared experts'.
            experts = expert_target_names(model_config)
            return KDA_LORA_TARGETS + MLP_TARGETS + tuple(t for t in experts if t not in MLP_TARGETS)
        if architecture in HYBRID_ARCHITECTURES:  # attention and MLP targets, and the gated delta-net's
            return ALIGNED_LORA_TARGETS + GATED_DELTA_NET_LORA_TARGETS
        if vocab and architecture in VOCAB_LORA_ARCHITECTURES:
            return ALIGNED_LORA_TARGETS + VOCAB_LORA_TARGETS
        experts = expert_target_names(model_config)
        if experts != EXPERT_TARGETS:  # Mixtral: every MLP is MoE, its experts named w1, w3, w2
            return ATTENTION_TARGETS + experts
        return ALIGNED_LORA_TARGETS
    has_q_lora = getattr(model_config, "q_lora_rank", None) is not None
    unused = ("q_proj",) if has_q_lora else ("q_a_proj", "q_b_proj")
    return tuple(t for t in MLA_LORA_TARGETS if t not in unused)


def _linear_attention_kind(model_config) -> str | None:
    from zero_mismatch_plugin.tables.architectures import describe

    linear = describe(model_config).linear_attention
    return None if linear is None else linear.kind


def peft_tensor_name(layer: int, target: str, which: str) -> str:
    """PEFT's name of the A or B matrix of ``target`` in decoder layer ``layer``."""
    return f"base_model.model.model.layers.{layer}.{PARENT_MODULE[target]}.{target}.lora_{which}.weight"


def parse_peft_tensor_name(name: str) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a PEFT adapter tensor name; other names are refused."""
    match = _TENSOR_NAME.match(name)
    if match is None or match.group(3) not in PARENT_MODULE or PARENT_MODULE[match.group(3)] != match.group(2):
        raise ValueError(f"{name}: not a decoder-layer LoRA tensor of {list(PARENT_MODULE)}")
    return int(match.group(1)), match.group(3), match.group(4)


def is_peft_lora_tensor_name(name: str) -> bool:
    """Whether ``name`` has the form of a PEFT LoRA tensor of a decoder-layer linear, a routed or
    shared expert, or the vocabulary."""
    return bool(_TENSOR_NAME.match(name) or _EXPERT_MODULE_NAME.match(name)) or name in _PEFT_VOCAB_TENSORS


def moe_checkpoint_names(model_config):
    """The checkpoint's MoE module names (block, gate, (gate, up, down) of an expert, shared), or
    None for a dense model (or a config that names no architecture)."""
    from zero_mismatch_plugin.tables.architectures import MOE_ARCHITECTURES, describe

    if (getattr(model_config, "architectures", None) or [None])[0] not in MOE_ARCHITECTURES:
        return None
    moe = describe(model_config).moe
    return None if moe is None else MOE_CHECKPOINT_NAMES[moe.names]


def expert_target_names(model_config) -> tuple[str, ...]:
    """The checkpoint's (and so PEFT's and vLLM's) names of a routed expert's gate, up and down
    linears, in :data:`EXPERT_TARGETS` order: Mixtral's ``w1, w3, w2``; ``gate_proj, up_proj,
    down_proj`` elsewhere."""
    names = moe_checkpoint_names(model_config)
    return EXPERT_TARGETS if names is None else tuple(names[2])


def peft_expert_module_name(layer: int, expert: int, target: str, model_config) -> str:
    """PEFT's (and vLLM's loader's) name of routed expert ``expert``'s ``target`` (one of
    :data:`EXPERT_TARGETS`) in layer ``layer``, under the checkpoint's names of ``model_config``."""
    names = moe_checkpoint_names(model_config)
    checkpoint_target = dict(zip(EXPERT_TARGETS, names[2]))[target]
    return f"base_model.model.model.layers.{layer}.{names[0]}.experts.{expert}.{checkpoint_target}"


def parse_peft_expert_tensor_name(name: str) -> tuple[int, int | None, str, str] | None:
    """(layer, routed expert or None for the shared expert, target in :data:`EXPERT_TARGETS`,
    "A" | "B") of a PEFT expert adapter tensor name, or None for any other name."""
    match = _EXPERT_MODULE_NAME.match(name)
    if match is None:
        return None
    layer, _, owner, target, which = match.groups()
    expert = None if owner.startswith("shared_expert") else int(owner.split(".")[1])
    return int(layer), expert, _CHECKPOINT_EXPERT_TARGET.get(target, target), which


def peft_shared_expert_module_name(layer: int, shared_name: str, target: str, block: str = "mlp") -> str:
    """PEFT's name of the shared expert's ``target`` in layer ``layer``; ``shared_name``: the
    checkpoint's module name (Qwen2-MoE's ``shared_expert``, GLM-4.5's ``shared_experts``) in the
    MoE block ``block`` (Kimi's ``block_sparse_moe``)."""
    return f"base_model.model.model.layers.{layer}.{block}.{shared_name}.{target}"
