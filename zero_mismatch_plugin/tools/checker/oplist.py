"""Canonical names of the ops of a decoder, in execution order, and bitwise comparison.

Both sides of a bisection report their op outputs under these names, so the comparison does not
depend on how either side groups its code; a fused residual-add + norm reports ``<norm>.input``
and ``<norm>``. Bitwise means equal and finite: a NaN or an infinity on either side fails that op.
The names (MoE, LoRA): docs/alignment-playbook.md, docs/lora.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from zero_mismatch_plugin.tables.architectures import VOCAB_LORA_TARGETS

EMBED = "embed"
FINAL_NORM = "final_norm"
LOGITS = "logits"
LOGPROBS = "logprobs"
# Ops of the model as a whole, not of one decoder layer.
MODEL_OPS = (EMBED, FINAL_NORM, LOGITS, LOGPROBS)

# Kind of op (what computes it) of each per-layer name's last part and of the final norm.
_KINDS = {
    "input_norm": "norm",
    "post_attention_norm": "norm",
    "q_norm": "norm",
    "k_norm": "norm",
    FINAL_NORM: "norm",
    "qkv_proj": "linear",
    "o_proj": "linear",
    "gate_up_proj": "linear",
    "down_proj": "linear",
    "rotary": "rotary",
    "attn": "attn",
    "act": "act",
    "router": "linear",
    "shared_expert_gate": "linear",
    "experts": "moe",
    "lora_shrink": "lora_shrink",
    "lora_expand": "lora_expand",
    # Linear-attention layers: their projections, and the token mixer's output (what the output
    # projection reads: the normed core of a gated delta-net or KDA layer).
    "in_proj_qkvz": "linear",
    "in_proj_ba": "linear",
    "out_proj": "linear",
    "in_proj": "linear",
    "g_a_proj": "linear",
    "g_b_proj": "linear",
    "f_b_proj": "linear",
    "mixer": "mixer",
}
# A linear-attention layer's ops between its input norm and its post-attention norm, by the
# blocks' kind, in vLLM's order (gated delta-net: QwenGatedDeltaNetAttention.forward_cpu; KDA:
# KimiGatedDeltaNetAttention.forward).
LINEAR_ATTENTION_OPS = {
    "gated_delta_net": ("in_proj_qkvz", "in_proj_ba", "mixer", "out_proj"),
    "kda": ("in_proj", "g_a_proj", "g_b_proj", "f_b_proj", "mixer", "o_proj"),
}
# The two steps of a LoRA-wrapped linear, recorded after its base output (``<linear>``):
# ``<linear>.lora_shrink`` (x A^T per slice, fp32) and ``<linear>.lora_expand`` (base + update).
LORA_STEPS = ("lora_shrink", "lora_expand")
# The merged linear (canonical name) holding each LoRA target module.
LORA_TARGET_LINEAR = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
}
# The linears of a SwiGLU MLP (of a shared expert too).
_MLP_LINEARS = frozenset({"gate_up_proj", "down_proj"})
# What the router of an MoE layer chose, recorded with its ``experts`` op (no op computes it alone).
TOPK_IDS = "topk_ids"
# Norms of the residual stream (fused residual-add norms in vLLM).
_RESIDUAL_NORMS = ("input_norm", "post_attention_norm", FINAL_NORM)


def mlp_op_names(prefix: str, moe=None) -> list[str]:
    """Names of one MLP's ops: dense SwiGLU, or (``moe``: the checkpoint's ``MoeBlocks``) the router,
    its choice, the routed experts and any shared expert, in the trainer faces' order."""
    if moe is None:
        return [prefix + "gate_up_proj", prefix + "act", prefix + "down_proj"]
    names = [prefix + "router", prefix + TOPK_IDS, prefix + "experts"]
    if moe.shared_expert_intermediate_size:
        names += [prefix + "shared_expert.gate_up_proj", prefix + "shared_expert.act", prefix + "shared_expert.down_proj"]
        if moe.shared_expert_gate:
            names.append(prefix + "shared_expert_gate")
    return names


def topk_ids_of(experts_name: str) -> str:
    """The name of the choice recorded with the MoE op ``experts_name``."""
    return experts_name.rsplit(".", 1)[0] + "." + TOPK_IDS


# A linear-attention hybrid's targets: the gated delta-net's linears are their own ops; a KDA
# layer's q/k/v, beta and f_a are vLLM's merged in_proj_qkvgfab, the others their own.
_LINEAR_ATTENTION_TARGET_LINEAR = {
    "gated_delta_net": {t: t for t in ("in_proj_qkvz", "in_proj_ba", "out_proj")},
    "kda": {"q_proj": "in_proj", "k_proj": "in_proj", "v_proj": "in_proj", "b_proj": "in_proj", "f_a_proj": "in_proj",
            "f_b_proj": "f_b_proj", "g_a_proj": "g_a_proj", "g_b_proj": "g_b_proj", "o_proj": "o_proj"},
}
# A routed expert's linears under Kimi's checkpoint names: an adapter on them is inside ``experts``.
_EXPERT_TARGET_LINEAR = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def lora_linears(targets, blocks=None) -> frozenset[str]:
    """The canonical linears an adapter on ``targets`` (PEFT module names) wraps (``blocks``: the
    checkpoint's ``Blocks``, for a linear-attention hybrid's own linears). The vocabulary targets
    have no steps of their own: ``embed`` and ``logits`` are compared with the adapter's update in
    them."""
    known = dict(LORA_TARGET_LINEAR)
    linear = getattr(blocks, "linear_attention", None)
    if linear is not None:
        known.update(_LINEAR_ATTENTION_TARGET_LINEAR[linear.kind], **_EXPERT_TARGET_LINEAR)
    layer_targets = [t for t in targets if t not in VOCAB_LORA_TARGETS]
    unknown = [t for t in layer_targets if t not in known]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} have no place in the op list (known: {list(known)})")
    return frozenset(known[t] for t in layer_targets)


def layer_op_names(index: int, qk_norm: bool, moe=None, lora: frozenset[str] = frozenset(),
                   linear_attention: str | None = None) -> list[str]:
    """Names of one decoder layer's ops, in the order vLLM's model code runs them (``moe``: the
    checkpoint's ``MoeBlocks`` when this layer's MLP is the Mixture-of-Experts;
    ``linear_attention``: the kind of this layer's linear attention, None for an attention layer);
    each of the layer's own linears in ``lora`` (see :func:`lora_linears`) is followed by its LoRA
    steps."""
    p = f"layers.{index}."
    names = [] if index == 0 else [p + "input_norm.input"]
    names.append(p + "input_norm")
    if linear_attention is not None:
        names += [p + op for op in LINEAR_ATTENTION_OPS[linear_attention]]
    else:
        names.append(p + "qkv_proj")
        if qk_norm:
            names += [p + "q_norm", p + "k_norm"]
        names += [p + "rotary", p + "attn", p + "o_proj"]
    names += [p + "post_attention_norm.input", p + "post_attention_norm"]
    names += mlp_op_names(p, moe)
    if lora:
        # An adapter on the MLP's linears is, in an MoE layer, on each routed expert (inside the
        # ``experts`` op) and on the shared expert's linears.
        wrapped = {p + linear for linear in lora} | {p + "shared_expert." + linear for linear in lora & _MLP_LINEARS}
        names = [step for name in names for step in _with_lora_steps(name, wrapped)]
    return names


def _with_lora_steps(name: str, wrapped: set[str]) -> list[str]:
    if name not in wrapped:
        return [name]
    return [name, *(f"{name}.{step}" for step in LORA_STEPS)]


def op_kind(name: str) -> str | None:
    """``norm``, ``linear``, ``rotary``, ``attn``, ``act``, ``moe``, ``mixer``, ``lora_shrink`` or
    ``lora_expand``: the op that computes ``name``; None for what no op of the op layer computes
    alone (the embedding, a norm's input, the router's choice, the head)."""
    return _KINDS.get(name.rsplit(".", 1)[-1])


def reads_residual(name: str) -> bool:
    """Whether the norm ``name`` normalises the residual stream (its input is recorded too)."""
    return name.rsplit(".", 1)[-1] in _RESIDUAL_NORMS


def norm_input(name: str) -> str:
    """The name of what the residual norm ``name`` reads: the embedding for layer 0's input
    norm, else ``<name>.input`` (the residual sum)."""
    return EMBED if name == "layers.0.input_norm" else name + ".input"


def op_names(num_layers: int, qk_norm: bool, blocks=None, lora: frozenset[str] = frozenset()) -> list[str]:
    """Every op of the model, embedding to logprobs, in execution order (``blocks``: the
    checkpoint's ``Blocks``, which says which layers' MLPs are MoE; None: every MLP is dense;
    ``lora``: the linears an adapter wraps, :func:`lora_linears`)."""
    names = [EMBED]
    for i in range(num_layers):
        moe = blocks.moe if blocks is not None and blocks.mlp_kind(i) == "moe" else None
        linear = blocks.linear_attention.kind if blocks is not None and blocks.mixer_kind(i) == "linear" else None
        names += layer_op_names(i, qk_norm, moe, lora, linear)
    names += [FINAL_NORM + ".input", FINAL_NORM, LOGITS, LOGPROBS]
    return names


def as_rows(value, rows: int | None = None) -> torch.Tensor:
    """One op output as a 2-D float32 tensor [rows, features] (tuples joined per row)."""
    if isinstance(value, (tuple, list)):
        parts = [as_rows(v, rows) for v in value]
        return torch.cat(parts, dim=-1)
    t = value.detach()
    if rows is None:
        rows = t.shape[0]
    return t.reshape(rows, -1).to(torch.float32)


@dataclass
class OpComparison:
    name: str
    equal: bool
    max_abs_diff: float
    equal_fraction: float
    numel: int
    num_differing: int = 0
    shape_mismatch: str | None = None
    # Non-finite values (NaN, +-inf) per side; None when both sides are finite everywhere.
    non_finite: dict[str, int] | None = None
    # At a layout: the ranks that computed the op, and those whose values differ (None in one process).
    ranks: list[int] | None = None
    differing_ranks: list[int] | None = None

    def as_dict(self) -> dict:
        """The report's JSON row (``name`` as ``op``, ``equal`` as ``bitwise_equal``; a shape
        mismatch and non-finite counts only when there are any, the ranks only at a layout)."""
        row = {_REPORT_KEYS.get(key, key): value for key, value in asdict(self).items()}
        for key in ("shape_mismatch", "non_finite", "ranks", "differing_ranks"):
            if row[key] is None or (key in ("shape_mismatch", "non_finite") and not row[key]):
                del row[key]
        return row

    @property
    def problem(self) -> str:
        """What is wrong with this op in words ("" when it is equal)."""
        if self.equal:
            return ""
        if self.shape_mismatch:
            return f"shapes differ: {self.shape_mismatch}"
        if self.non_finite:
            return (f"non-finite values in op {self.name} (engine {self.non_finite['engine']}, "
                    f"trainer {self.non_finite['trainer']} of {self.numel})")
        return f"max |Δ| {self.max_abs_diff:.3g}, {100 * self.equal_fraction:.1f}% of {self.numel} values equal"


_REPORT_KEYS = {"name": "op", "equal": "bitwise_equal"}


def bitwise_equal_finite(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Where both values are finite and equal (same shape in): a NaN or an infinity is never
    equal, on either side, even to itself."""
    return (reference == candidate) & torch.isfinite(reference) & torch.isfinite(candidate)


def non_finite_counts(engine, trainer) -> dict[str, int] | None:
    """NaN / +-inf values of each side (a tensor or a tuple of them), or None when there are none."""
    counts = {"engine": _non_finite(engine), "trainer": _non_finite(trainer)}
    return counts if any(counts.values()) else None


def _non_finite(value) -> int:
    if isinstance(value, (tuple, list)):
        return sum(_non_finite(v) for v in value)
    t = value.detach()
    return int((~torch.isfinite(t)).sum().item()) if t.is_floating_point() else 0


def compare_op(name: str, reference, candidate) -> OpComparison:
    """Bitwise comparison of one op's outputs (reference = engine side); non-finite values on
    either side fail it (see the module docstring)."""
    ref = as_rows(reference)
    cand = as_rows(candidate, ref.shape[0]) if numel(candidate) == ref.numel() else None
    if cand is None or cand.shape != ref.shape:
        return OpComparison(
            name,
            equal=False,
            max_abs_diff=math.inf,
            equal_fraction=0.0,
            numel=ref.numel(),
            num_differing=ref.numel(),
            shape_mismatch=f"engine {tuple(ref.shape)} vs trainer {_shape(candidate)}",
            non_finite=non_finite_counts(reference, candidate),
        )
    same = bitwise_equal_finite(ref, cand)
    finite = torch.isfinite(ref) & torch.isfinite(cand)
    # The largest difference among values finite on both sides (non-finite ones are counted apart).
    diff = torch.where(same | ~finite, torch.zeros_like(ref), (ref - cand).abs())
    max_diff = float(diff.max().item()) if diff.numel() else 0.0
    num_equal = int(same.sum().item())
    return OpComparison(
        name,
        equal=num_equal == same.numel(),
        max_abs_diff=max_diff,
        equal_fraction=num_equal / same.numel() if same.numel() else 1.0,
        numel=ref.numel(),
        num_differing=same.numel() - num_equal,
        non_finite=non_finite_counts(ref, cand),
    )


def numel(value) -> int:
    if isinstance(value, (tuple, list)):
        return sum(numel(v) for v in value)
    return value.numel()


def _shape(value):
    if isinstance(value, (tuple, list)):
        return tuple(_shape(v) for v in value)
    return tuple(value.shape)
