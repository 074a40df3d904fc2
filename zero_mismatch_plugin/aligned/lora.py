"""LoRA on the dense linears: a frozen base plus a trainable adapter, with vLLM's LoRA arithmetic.

vLLM serves an adapter without merging it into the base weight. At load it multiplies B by the
adapter's scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) in the LoRA dtype; at
every step a LoRA-wrapped linear computes ``y = base(x) + bias``, then per output slice (q, k, v;
gate, up) ``buf = x A^T`` into an fp32 buffer and ``y[:, slice] += buf B'^T``, with A and B
zero-padded to the engine's ``max_lora_rank``. :class:`AlignedLoRALinear` calls the same punica
wrapper vLLM's layers call (``PunicaWrapperCPU`` on CPU) on the trainer's A and B in that
layout, so its output bits are the engine's; its backward, for A and B only (the base is frozen),
is plain fp32 torch.

An adapter is read from and written to PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``), the format ``vllm.lora.request.LoRARequest`` loads; vLLM's own
``PEFTHelper`` reads the config and computes the scaling. Targets are the dense linears vLLM
wraps (``ALIGNED_LORA_TARGETS``), and on multi-head latent attention the projections vLLM applies
an adapter to on every token (``supported_lora_targets``: q / q_a / q_b, kv_a, o), and in the
aligned model face ``embed_tokens`` / ``lm_head`` for the models whose engine adapts them
(:class:`AlignedLoRAEmbedding`, :class:`AlignedLoRALogits`: vLLM's LoRA embedding and logits
layers). DoRA, adapter biases, ``modules_to_save``, per-module rank or alpha patterns,
``fan_in_fan_out``, and the targets vLLM does not apply (``REFUSED_LORA_TARGETS``: MLA's kv_b_proj,
which vLLM wraps but never applies; the MoE router; embedding / lm_head elsewhere) are refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.autograd import Function

from zero_mismatch_plugin.tables.architectures import LORA_TARGETS as ALIGNED_LORA_TARGETS
from zero_mismatch_plugin.tables.architectures import MLA_LORA_TARGETS, MOE_CHECKPOINT_NAMES, REFUSED_LORA_TARGETS
from zero_mismatch_plugin.tables.architectures import VOCAB_LORA_ARCHITECTURES, VOCAB_LORA_TARGETS
from zero_mismatch_plugin.aligned.derived import DerivedWeight
from zero_mismatch_plugin.aligned.ops import _observable

ATTENTION_TARGETS = ALIGNED_LORA_TARGETS[:4]
MLP_TARGETS = ALIGNED_LORA_TARGETS[4:]

# The merged linears of the aligned model and the checkpoint modules stacked in them, in order.
MERGED_TARGETS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$"
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

_PARENT = {
    **{t: "self_attn" for t in ATTENTION_TARGETS + MLA_ATTENTION_TARGETS},
    **{t: "mlp" for t in MLP_TARGETS},
}


def supported_lora_targets(model_config, vocab: bool = False) -> tuple[str, ...]:
    """The checkpoint modules the aligned LoRA path adapts for this model: the dense linears, or
    for multi-head latent attention the projections vLLM applies an adapter to on every token
    (``q_proj`` without, ``q_a_proj`` / ``q_b_proj`` with a query low-rank projection). With
    ``vocab`` (the aligned model face) also ``embed_tokens`` / ``lm_head`` for the architectures
    whose engine adapts them (``VOCAB_LORA_ARCHITECTURES``)."""
    if getattr(model_config, "kv_lora_rank", None) is None:
        architecture = (getattr(model_config, "architectures", None) or [None])[0]
        if vocab and architecture in VOCAB_LORA_ARCHITECTURES:
            return ALIGNED_LORA_TARGETS + VOCAB_LORA_TARGETS
        experts = expert_target_names(model_config)
        if experts != EXPERT_TARGETS:  # Mixtral: every MLP is MoE, its experts named w1, w3, w2
            return ATTENTION_TARGETS + experts
        return ALIGNED_LORA_TARGETS
    has_q_lora = getattr(model_config, "q_lora_rank", None) is not None
    unused = ("q_proj",) if has_q_lora else ("q_a_proj", "q_b_proj")
    return tuple(t for t in MLA_LORA_TARGETS if t not in unused)


def lora_scaling(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The factor the low-rank update BA is multiplied by: ``alpha / r`` (LoRA, Hu et al. 2021),
    or ``alpha / sqrt(r)`` (rsLoRA, Kalajdzievski 2023). vLLM folds it into B at load."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def peft_tensor_name(layer: int, target: str, which: str) -> str:
    """PEFT's name of the A or B matrix of ``target`` in decoder layer ``layer``."""
    return f"base_model.model.model.layers.{layer}.{_PARENT[target]}.{target}.lora_{which}.weight"


def parse_peft_tensor_name(name: str) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a PEFT adapter tensor name; other names are refused."""
    match = _TENSOR_NAME.match(name)
    if match is None or match.group(3) not in _PARENT or _PARENT[match.group(3)] != match.group(2):
        raise ValueError(f"{name}: not a decoder-layer LoRA tensor of {list(ALIGNED_LORA_TARGETS)}")
    return int(match.group(1)), match.group(3), match.group(4)


# ----- adapter config ----------------------------------------------------------------------


@dataclass(frozen=True)
class LoRAConfig:
    """What the aligned path reads from a PEFT ``adapter_config.json``."""

    r: int
    lora_alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    # PEFT's ``target_parameters``: the routed experts' 3-D gate_up_proj / down_proj (:mod:`.lora_formats`).
    target_parameters: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return lora_scaling(self.lora_alpha, self.r, self.use_rslora)

    def as_peft_dict(self) -> dict:
        return dict(
            peft_type="LORA",
            task_type="CAUSAL_LM",
            r=self.r,
            lora_alpha=self.lora_alpha,
            target_modules=list(self.targets),
            target_parameters=list(self.target_parameters) or None,
            use_rslora=self.use_rslora,
            use_dora=False,
            bias="none",
            modules_to_save=None,
            lora_dropout=0.0,
            fan_in_fan_out=False,
        )


def unsupported_lora_settings(config: dict, supported: tuple[str, ...] = ALIGNED_LORA_TARGETS) -> list[str]:
    """Every setting of a PEFT adapter config the aligned LoRA path does not run, with the change
    that fixes it; ``supported``: the model's targets (:func:`supported_lora_targets`)."""
    from zero_mismatch_plugin.aligned.lora_formats import unsupported_target_parameters

    out = unsupported_target_parameters(config)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        out.append(f"peft_type={peft_type!r}: only LORA adapters")
    if config.get("use_dora"):
        out.append("use_dora=true (DoRA): vLLM does not serve DoRA; train a plain LoRA (use_dora=false)")
    if config.get("bias", "none") != "none":
        out.append(f"bias={config['bias']!r}: adapter biases are not served by vLLM; set bias='none'")
    if config.get("modules_to_save"):
        out.append(
            f"modules_to_save={config['modules_to_save']}: fully trained modules are not served by "
            "vLLM for a causal LM; set modules_to_save=null"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            out.append(f"{key}={config[key]}: per-module ranks/alphas are not supported; remove {key}")
    if config.get("fan_in_fan_out"):
        out.append("fan_in_fan_out=true: only nn.Linear-layout adapters; set fan_in_fan_out=false")
    for key in ("layers_to_transform", "layers_pattern"):
        if config.get(key) not in (None, [], ""):
            out.append(f"{key}={config[key]!r}: adapters on a subset of layers are not supported; remove {key}")
    if config.get("use_qalora") or config.get("lora_bias"):
        out.append("lora_bias / QA-LoRA: not supported; train a plain LoRA")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets in supported else None
        if targets is None:
            out.append(
                f"target_modules={config['target_modules']!r}: give the target modules as a list "
                f"of names from {list(supported)}"
            )
    if isinstance(targets, (list, tuple)):
        refused = [t for t in targets if t in REFUSED_LORA_TARGETS and t not in supported]
        out.extend(f"target_modules {t!r}: {REFUSED_LORA_TARGETS[t]}; remove it" for t in refused)
        bad = [t for t in targets if t not in supported and t not in refused]
        if bad:
            out.append(
                f"target_modules {bad}: the aligned LoRA path covers {list(supported)} "
                "(the MoE router is not aligned)"
            )
        if not targets and not config.get("target_parameters"):
            out.append("target_modules is empty")
    elif targets is None and not out and not config.get("target_parameters"):
        out.append("target_modules is missing")
    r = config.get("r")
    if not isinstance(r, int) or r <= 0:
        out.append(f"r={r!r}: the rank must be a positive integer")
    return out


def malformed_lora_settings(config) -> list[str]:
    """What in an ``adapter_config.json`` (as read from JSON) is not what PEFT writes, one
    sentence each: not an object, a ``lora_alpha`` that is not a finite number, ``target_modules``
    that are not module names, a NaN or an infinity anywhere. Empty when it can be read."""
    if not isinstance(config, dict):
        return [f"not a JSON object (it holds a {type(config).__name__}): PEFT writes one object of settings"]
    out = []
    bad_numbers = sorted(k for k, v in config.items() if isinstance(v, float) and not math.isfinite(v))
    out.extend(f"{k}={config[k]!r}: give a finite number" for k in bad_numbers)
    alpha = config.get("lora_alpha")
    if "lora_alpha" not in config:
        out.append("lora_alpha is missing: give the adapter's alpha (a number)")
    elif "lora_alpha" not in bad_numbers and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        out.append(f"lora_alpha={alpha!r}: must be a number (PEFT writes e.g. 16), not a {type(alpha).__name__}")
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        out.append(f"target_modules={targets!r}: give module names, a list of strings")
    for key in ("use_rslora", "use_dora"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            out.append(f"{key}={config[key]!r}: must be true or false")
    return out


def read_lora_config(adapter_dir: str | os.PathLike, supported: tuple[str, ...] = ALIGNED_LORA_TARGETS) -> LoRAConfig:
    """Read and check ``adapter_config.json`` with vLLM's ``PEFTHelper``; refuse what the aligned
    path does not run for a model adapting ``supported``, naming each setting; a file that is not
    a readable adapter config (:func:`malformed_lora_settings`) is a ``ValueError`` naming it."""
    from vllm.lora.peft_helper import PEFTHelper

    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: a PEFT adapter directory needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON file ({error})") from None
    malformed = malformed_lora_settings(raw)
    if malformed:
        raise ValueError(f"{path}: " + "; ".join(malformed))
    problems = unsupported_lora_settings(raw, supported)
    if problems:
        raise NotImplementedError(f"{adapter_dir}: LoRA adapter not supported: " + "; ".join(problems))
    helper = PEFTHelper.from_dict({**raw, "vllm_max_position_embeddings": None})
    targets = raw.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    parameters = raw.get("target_parameters") or ()
    config = LoRAConfig(
        r=helper.r, lora_alpha=helper.lora_alpha, targets=targets, use_rslora=bool(helper.use_rslora),
        target_parameters=(parameters,) if isinstance(parameters, str) else tuple(parameters),
    )
    if config.scaling != helper.vllm_lora_scaling_factor:
        raise AssertionError(
            f"scaling {config.scaling} differs from vLLM's {helper.vllm_lora_scaling_factor}"
        )
    return config


def lora_engine_args(adapter_dir: str | os.PathLike, max_loras: int = 2) -> dict:
    """Engine arguments serving the adapter in ``adapter_dir`` (engine and trainer both take them).

    ``max_lora_rank``: the smallest rank vLLM accepts that holds the adapter; ``max_loras`` 2: the
    adapter's current and next version can be served side by side during a sync;
    ``enable_mixed_moe_lora_format`` for a 3-D expert adapter (:mod:`.lora_formats`).
    """
    try:
        return lora_engine_args_for_config(read_lora_config(adapter_dir), max_loras)
    except NotImplementedError as error:
        raise NotImplementedError(f"{adapter_dir}: {error}") from None


def lora_engine_args_for_config(config: LoRAConfig, max_loras: int = 2) -> dict:
    """Engine arguments serving an adapter of this config (see :func:`lora_engine_args`)."""
    args = lora_engine_args_for_rank(config.r, max_loras)
    if config.target_parameters:
        args["enable_mixed_moe_lora_format"] = True
    return args


def lora_engine_args_for_rank(r: int, max_loras: int = 2) -> dict:
    """Engine arguments serving adapters of rank ``r`` (see :func:`lora_engine_args`)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(get_args(MaxLoRARanks))
    if r > ranks[-1]:
        raise NotImplementedError(f"rank {r} exceeds vLLM's largest max_lora_rank {ranks[-1]}")
    return dict(enable_lora=True, max_lora_rank=min(x for x in ranks if x >= r), max_loras=max_loras)


def write_peft_adapter(adapter_dir: str | os.PathLike, lora_config: LoRAConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` (PEFT names) and ``lora_config`` in PEFT's format, what ``LoRARequest``
    loads; return the directory."""
    from safetensors.torch import save_file

    out = Path(adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(lora_config.as_peft_dict(), indent=1))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    return out


# ----- adapter parameters ------------------------------------------------------------------


class _LoRAPair(nn.Module):
    def __init__(self, r: int, in_features: int, out_features: int):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(r, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))


def _target_shapes(config, head_dim: int) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every LoRA target of a decoder layer (dense or MLA attention)."""
    h, inter = config.hidden_size, config.intermediate_size
    if getattr(config, "kv_lora_rank", None) is not None:
        return _mla_target_shapes(config)
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    return dict(
        q_proj=(q, h), k_proj=(kv, h), v_proj=(kv, h), o_proj=(h, q),
        gate_proj=(inter, h), up_proj=(inter, h), down_proj=(h, inter),
    )


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


# ----- LoRA on routed MoE experts ------------------------------------------------------------

# The MLP targets, in a Mixture-of-Experts layer those of each routed expert: vLLM loads them as
# per-expert modules (``mlp.experts.{e}.gate_proj`` ...) and serves the three together; and of the
# shared expert, if the layer has one (a dense SwiGLU: vLLM's dense LoRA layers).
EXPERT_TARGETS = MLP_TARGETS
_EXPERT_MODULE_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.(experts\.\d+|shared_experts?)\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.lora_(A|B)\.weight$"
)


def _moe_checkpoint_names(model_config):
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
    names = _moe_checkpoint_names(model_config)
    return EXPERT_TARGETS if names is None else tuple(names[2])


def peft_expert_module_name(layer: int, expert: int, target: str, model_config) -> str:
    """PEFT's (and vLLM's loader's) name of routed expert ``expert``'s ``target`` (one of
    :data:`EXPERT_TARGETS`) in layer ``layer``, under the checkpoint's names of ``model_config``."""
    names = _moe_checkpoint_names(model_config)
    checkpoint_target = dict(zip(EXPERT_TARGETS, names[2]))[target]
    return f"base_model.model.model.layers.{layer}.{names[0]}.experts.{expert}.{checkpoint_target}"


# Every checkpoint's name of an expert linear -> its EXPERT_TARGETS name (Mixtral's w1 -> gate_proj ...).
_CHECKPOINT_EXPERT_TARGET = {name: target for names in MOE_CHECKPOINT_NAMES.values()
                             for name, target in zip(names[2], EXPERT_TARGETS)}


def parse_peft_expert_tensor_name(name: str) -> tuple[int, int | None, str, str] | None:
    """(layer, routed expert or None for the shared expert, target in :data:`EXPERT_TARGETS`,
    "A" | "B") of a PEFT expert adapter tensor name, or None for any other name."""
    match = _EXPERT_MODULE_NAME.match(name)
    if match is None:
        return None
    layer, _, owner, target, which = match.groups()
    expert = None if owner.startswith("shared_expert") else int(owner.split(".")[1])
    return int(layer), expert, _CHECKPOINT_EXPERT_TARGET.get(target, target), which


def peft_shared_expert_module_name(layer: int, shared_name: str, target: str) -> str:
    """PEFT's name of the shared expert's ``target`` in layer ``layer``; ``shared_name``: the
    checkpoint's module name (Qwen2-MoE's ``shared_expert``, GLM-4.5's ``shared_experts``)."""
    return f"base_model.model.model.layers.{layer}.mlp.{shared_name}.{target}"


def _routed_expert_layers(model_config) -> tuple[dict[int, int], dict[str, tuple[int, int]], str | None, dict]:
    """({MoE layer: number of routed experts}, {target: (out, in)} of one routed expert, the
    checkpoint's name of the shared expert module or None, {target: (out, in)} of the shared
    expert); empty for a dense model."""
    from zero_mismatch_plugin.tables.architectures import describe

    blocks = describe(model_config)
    if blocks.moe is None:
        return {}, {}, None, {}
    moe, h = blocks.moe, model_config.hidden_size
    layers = {i: moe.num_experts for i in range(model_config.num_hidden_layers) if blocks.mlp_kind(i) == "moe"}
    shared_name = MOE_CHECKPOINT_NAMES[moe.names][3] if moe.shared_expert_intermediate_size else None
    width, shared = moe.moe_intermediate_size, moe.shared_expert_intermediate_size
    return (layers, dict(gate_proj=(width, h), up_proj=(width, h), down_proj=(h, width)), shared_name,
            dict(gate_proj=(shared, h), up_proj=(shared, h), down_proj=(h, shared)) if shared_name else {})


def _expert_module(r: int, shapes: dict[str, tuple[int, int]]) -> nn.Module:
    expert = nn.Module()
    for target, (out_f, in_f) in shapes.items():
        setattr(expert, target, _LoRAPair(r, in_f, out_f))
    return expert


class LoRAAdapter(nn.Module):
    """The trainable A [r, in] and B [out, r] of every target of every layer (fp32, PEFT layout).

    Parameters are named ``layers.{i}.{target}.lora_A`` / ``lora_B``, and ``embed_tokens.lora_A``
    [r, vocab] / ``lora_B`` [hidden, r] (PEFT's ``lora_embedding_A`` / ``_B``), ``lm_head.lora_A``
    [r, hidden] / ``lora_B`` [vocab, r]; :meth:`save` writes them under PEFT's names. In a
    Mixture-of-Experts layer the MLP targets are those of every routed expert
    (``layers.{i}.experts.{e}.{target}``, see :data:`EXPERT_TARGETS`) and of the shared expert; for a
    3-D expert adapter (``target_parameters``) PEFT's fused tensors of the layer's routed experts
    (``layers.{i}.experts.gate_up_proj`` / ``down_proj``, :class:`~.lora_formats.FusedExpertLoRA`).
    """

    def __init__(self, lora_config: LoRAConfig, model_config, head_dim: int):
        super().__init__()
        self.lora_config = lora_config
        shapes = _target_shapes(model_config, head_dim)
        # Parameters are named by EXPERT_TARGETS whatever the checkpoint calls an expert's linears.
        canonical = dict(zip(expert_target_names(model_config), EXPERT_TARGETS))
        self.model_config = model_config
        self.layer_targets = tuple(canonical.get(t, t) for t in lora_config.targets if t not in VOCAB_LORA_TARGETS)
        expert_targets = [t for t in self.layer_targets if t in EXPERT_TARGETS]
        fused_experts = bool(lora_config.target_parameters)
        moe_layers, expert_shapes, self.shared_name, shared_shapes = _routed_expert_layers(model_config)
        block = (_moe_checkpoint_names(model_config) or [None])[0] if moe_layers else None
        if fused_experts and block != "mlp":
            raise NotImplementedError(
                f"target_parameters {list(lora_config.target_parameters)}: 3-D expert adapters are covered on "
                f"routed experts under mlp.experts (Qwen-style MoE); the model has "
                f"{'no routed experts' if block is None else f'them under {block}'}"
            )
        if moe_layers and expert_targets and len(expert_targets) != len(EXPERT_TARGETS):
            raise NotImplementedError(
                f"target_modules {[t for t in lora_config.targets if canonical.get(t, t) in EXPERT_TARGETS]}: "
                f"on routed experts vLLM serves {', '.join(canonical)} together; target all three or none"
            )
        self.layers = nn.ModuleList()
        for index in range(model_config.num_hidden_layers):
            layer = nn.Module()
            for target in self.layer_targets:
                if index in moe_layers and target in EXPERT_TARGETS:
                    continue
                out_f, in_f = shapes[target]
                setattr(layer, target, _LoRAPair(lora_config.r, in_f, out_f))
            if index in moe_layers and expert_targets:
                layer.experts = nn.ModuleList(_expert_module(lora_config.r, expert_shapes) for _ in range(moe_layers[index]))
                if self.shared_name:
                    layer.shared_expert = _expert_module(lora_config.r, shared_shapes)
            elif index in moe_layers and fused_experts:
                from zero_mismatch_plugin.aligned.lora_formats import FusedExpertLoRA

                layer.experts = FusedExpertLoRA(lora_config.r, moe_layers[index], expert_shapes)
            self.layers.append(layer)
        vocab, hidden = model_config.vocab_size, model_config.hidden_size
        vocab_shapes = {"embed_tokens": (hidden, vocab), "lm_head": (vocab, hidden)}
        for target in lora_config.targets:
            if target in VOCAB_LORA_TARGETS:
                out_f, in_f = vocab_shapes[target]
                setattr(self, target, _LoRAPair(lora_config.r, in_f, out_f))

    def vocab_pair(self, target: str) -> _LoRAPair | None:
        """The adapter of ``embed_tokens`` or ``lm_head``, or None."""
        return getattr(self, target, None) if target in self.lora_config.targets else None

    def _named_matrices(self):
        """(PEFT name, parameter) of every A and B."""
        for i, target, pair in self.pairs():
            yield peft_tensor_name(i, target, "A"), pair.lora_A
            yield peft_tensor_name(i, target, "B"), pair.lora_B
        from zero_mismatch_plugin.aligned.lora_formats import FusedExpertLoRA

        for i in range(len(self.layers)):
            experts = getattr(self.layers[i], "experts", None)
            if isinstance(experts, FusedExpertLoRA):  # a 3-D expert adapter: PEFT's fused tensors
                yield from experts.named_matrices(i)
            routed = [] if isinstance(experts, FusedExpertLoRA) else self.expert_pairs(i) or []
            modules = [(peft_expert_module_name(i, e, t, self.model_config), pair)
                       for e, targets in enumerate(routed) for t, pair in targets.items()]
            modules += [(peft_shared_expert_module_name(i, self.shared_name, t), pair)
                        for t, pair in (self.shared_expert_pairs(i) or {}).items()]
            for module, pair in modules:
                yield f"{module}.lora_A.weight", pair.lora_A
                yield f"{module}.lora_B.weight", pair.lora_B
        for target in VOCAB_LORA_TARGETS:
            pair = self.vocab_pair(target)
            if pair is not None:
                yield PEFT_VOCAB_NAMES[target][0], pair.lora_A
                yield PEFT_VOCAB_NAMES[target][1], pair.lora_B

    def pair(self, layer: int, target: str) -> _LoRAPair | None:
        return getattr(self.layers[layer], target, None)

    def pairs(self):
        """(layer, target, pair) of every decoder-layer target."""
        for i, layer in enumerate(self.layers):
            for target in self.layer_targets:
                pair = getattr(layer, target, None)
                if pair is not None:
                    yield i, target, pair

    def expert_pairs(self, layer: int) -> list[dict[str, _LoRAPair]] | None:
        """The adapter of each routed expert of MoE layer ``layer`` ({target: pair}), or None."""
        from zero_mismatch_plugin.aligned.lora_formats import FusedExpertLoRA

        experts = getattr(self.layers[layer], "experts", None)
        if isinstance(experts, FusedExpertLoRA):  # a 3-D expert adapter: views of its fused tensors
            return experts.expert_pairs()
        return None if experts is None else [{t: getattr(m, t) for t in EXPERT_TARGETS} for m in experts]

    def shared_expert_pairs(self, layer: int) -> dict[str, _LoRAPair] | None:
        """The adapter of MoE layer ``layer``'s shared expert ({target: pair}), or None."""
        shared = getattr(self.layers[layer], "shared_expert", None)
        return None if shared is None else {t: getattr(shared, t) for t in EXPERT_TARGETS}

    def peft_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().contiguous() for name, p in self._named_matrices()}

    def load_peft_state(self, state: dict[str, torch.Tensor], where: str = "adapter") -> None:
        expected = dict(self._named_matrices())
        unexpected = sorted(set(state) - set(expected))
        missing = sorted(set(expected) - set(state))
        if unexpected or missing:
            hint = [n for n in unexpected
                    if not (_TENSOR_NAME.match(n) or _EXPERT_MODULE_NAME.match(n)) and n not in _PEFT_VOCAB_TENSORS]
            raise ValueError(
                f"{where}: tensors do not match the config's targets: missing {missing[:4]}"
                f"{'...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                + (f" (not a decoder-layer LoRA tensor: {hint[:2]})" if hint else "")
            )
        with torch.no_grad():
            for name, p in expected.items():
                t = state[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    def save(self, adapter_dir: str | os.PathLike) -> Path:
        """Write the adapter in PEFT's format (what ``LoRARequest`` loads); return the directory."""
        return write_peft_adapter(adapter_dir, self.lora_config, self.peft_state())

    @classmethod
    def from_dir(cls, adapter_dir: str | os.PathLike, model_config, head_dim: int, vocab: bool = False) -> "LoRAAdapter":
        """``vocab``: the reader adapts ``embed_tokens`` / ``lm_head`` too (the aligned model face)."""
        from safetensors.torch import load_file

        lora_config = read_lora_config(adapter_dir, supported_lora_targets(model_config, vocab))
        path = Path(adapter_dir) / WEIGHTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the adapter's weights ({WEIGHTS_FILE}) are missing")
        adapter = cls(lora_config, model_config, head_dim)
        adapter.load_peft_state(load_file(str(path)), where=str(adapter_dir))
        return adapter


def build_adapter(
    adapter_dir: str | os.PathLike,
    model_dir: str | os.PathLike,
    r: int = 8,
    lora_alpha: float = 16,
    targets=None,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.05,
) -> Path:
    """Write a random PEFT adapter for the checkpoint in ``model_dir`` (A and B both non-zero, so
    the adapter changes the logits from the first step; PEFT's own init has B = 0). ``targets``:
    by default every decoder-layer module the aligned path adapts for that model (``embed_tokens``
    and ``lm_head`` only when named)."""
    from transformers import AutoConfig

    from zero_mismatch_plugin.tables.architectures import describe

    model_config = AutoConfig.from_pretrained(str(model_dir))
    targets = supported_lora_targets(model_config) if targets is None else targets
    supported = supported_lora_targets(model_config, vocab=True)
    config = LoRAConfig(r=r, lora_alpha=lora_alpha, targets=tuple(targets), use_rslora=use_rslora)
    problems = unsupported_lora_settings(config.as_peft_dict(), supported)
    if problems:
        raise ValueError("; ".join(problems))
    adapter = LoRAAdapter(config, model_config, describe(model_config).head_dim)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(std * torch.randn(p.shape, generator=gen))
    return adapter.save(adapter_dir)


# ----- the op ------------------------------------------------------------------------------


class _TokenMapping:
    """vLLM's punica wrapper with every token of the batch mapped to adapter slot 0 (prefill
    metadata, as the engine sets it for a prompt). ``sampled_rows``: every row is also a sampled
    row (the logits' ``sampler_indices``, one per row, as the engine maps each request's row)."""

    def __init__(self, runtime, sampled_rows: bool = False):
        self.runtime = runtime
        self.sampled_rows = sampled_rows
        self.capacity = 0
        self.wrapper = None
        self.tokens = None

    def get(self, num_tokens: int):
        from vllm.lora.layers.utils import LoRAMapping
        from vllm.lora.punica_wrapper import get_punica_wrapper

        if num_tokens > self.capacity:
            self.capacity = max(num_tokens, 2 * self.capacity, 256)
            with self.runtime.context():
                self.wrapper = get_punica_wrapper(self.capacity, 1, self.runtime.device)
            self.tokens = None
        if self.tokens != num_tokens:
            mapping = LoRAMapping((1,) * num_tokens, (1,) * (num_tokens if self.sampled_rows else 1), is_prefill=True)
            self.wrapper.update_metadata(mapping, [1], 2, self.runtime.hf_config.vocab_size)
            self.tokens = num_tokens
        return self.wrapper


# The two steps of vLLM's LoRA linear, in order: ``buf = x A^T`` (fp32), then ``y += buf B'^T``.
LORA_STEPS = ("lora_shrink", "lora_expand")


class LoRAStep:
    """One step of vLLM's LoRA linear (``lora_shrink`` or ``lora_expand``) as an op of its own:
    the unit an observer of the op layer (``zmrl bisect``) sees and names."""

    def __init__(self, kind: str):
        self.kind = kind

    @_observable
    def __call__(self, run, out):
        """``run()`` performs vLLM's step in place on ``out`` (a tensor, or shrink's tuple of buffers)."""
        run()
        return out


def _copy_into(dst, src) -> None:
    if src is dst:
        return
    for d, s in zip(dst, src) if isinstance(dst, (tuple, list)) else ((dst, src),):
        if s is not d:
            d.copy_(s)


class SteppedPunica:
    """vLLM's punica wrapper whose ``add_lora_linear`` (vLLM's own code, run on this object)
    hands its two steps to ``step(kind, run, out)``.

    ``add_lora_linear`` allocates the fp32 buffers and calls ``self.add_shrink`` then
    ``self.add_expand``; here each runs as ``step("lora_shrink" | "lora_expand", run, out)``,
    where ``run()`` is vLLM's step on ``out`` in place and ``step`` returns ``out`` or a replacement,
    copied into vLLM's buffer so the rest of the computation uses it. Every other attribute is
    the wrapper's (the token mapping the engine or the trainer set).
    """

    def __init__(self, wrapper, step):
        self._wrapper = wrapper
        self._step = step

    def __getattr__(self, name):
        return getattr(self._wrapper, name)

    def add_lora_linear(self, *args, **kwargs):
        return type(self._wrapper).add_lora_linear(self, *args, **kwargs)

    def add_shrink(self, y, *args, **kwargs):
        _copy_into(y, self._step("lora_shrink", lambda: self._wrapper.add_shrink(y, *args, **kwargs), y))

    def add_expand(self, y, *args, **kwargs):
        _copy_into(y, self._step("lora_expand", lambda: self._wrapper.add_expand(y, *args, **kwargs), y))


def _engine_lora_config(runtime, r: int):
    """The engine's LoRA settings (``enable_lora``, ``max_lora_rank``), checked to serve rank ``r``."""
    lora = runtime.vllm_config.lora_config
    if lora is None:
        raise ValueError("the trainer's engine arguments need enable_lora=True (as the engine's)")
    if r > lora.max_lora_rank:
        raise ValueError(f"adapter rank {r} > max_lora_rank {lora.max_lora_rank}: raise max_lora_rank")
    return lora


class AlignedLoRALinear:
    """vLLM's LoRA-wrapped linear over a frozen :class:`~.ops.AlignedLinear` and trainable A, B.

    ``pairs[i]`` is the adapter (``lora_A`` [r, in], ``lora_B`` [out_i, r]) of vLLM's i-th output
    slice or None (no adapter on that part: vLLM's slice stays zero). ``out_sizes``: vLLM's slices
    (q, k, v; gate, up), by default the base's stacked parts. A base whose rows are permuted
    against vLLM's (megatron's grouped qkv, ``engine_rows``) gets the update in vLLM's row order,
    as the engine adds it, and hands the sum back in its own order (a permutation, exact).
    """

    def __init__(self, runtime, base, pairs, lora_config: LoRAConfig, mapping: _TokenMapping, out_sizes=None):
        self.out_sizes = list(out_sizes if out_sizes is not None else base.out_sizes)
        if len(pairs) != len(self.out_sizes) or sum(self.out_sizes) != sum(base.out_sizes):
            raise ValueError("one adapter pair (or None) per output slice of the base linear")
        lora = _engine_lora_config(runtime, lora_config.r)
        self.runtime = runtime
        self.base = base
        self.pairs = list(pairs)
        self.scaling = lora_config.scaling
        self.max_rank = lora.max_lora_rank
        self.lora_dtype = lora.lora_dtype
        self.mapping = mapping
        self.params = [t for p in self.pairs if p is not None for t in (p.lora_A, p.lora_B)]
        self.derived = DerivedWeight(self.params, self._build)
        self.steps = {kind: LoRAStep(kind) for kind in LORA_STEPS}

    def _build(self, sources):
        """(lora_a_stacked, lora_b_stacked): vLLM's per-slice [1, 1, max_rank, in] and
        [1, 1, out, max_rank] buffers, B cast to the LoRA dtype then scaled (vLLM's order)."""
        it = iter(sources)
        in_features = self.base.weights[0].shape[1]
        device = self.base.weights[0].device
        a_stacked, b_stacked = [], []
        for pair, out_size in zip(self.pairs, self.out_sizes):
            a = torch.zeros(1, 1, self.max_rank, in_features, dtype=self.lora_dtype, device=device)
            b = torch.zeros(1, 1, out_size, self.max_rank, dtype=self.lora_dtype, device=device)
            if pair is not None:
                lora_a, lora_b = next(it), next(it)
                r = lora_a.shape[0]
                a[0, 0, :r] = lora_a.to(self.lora_dtype)
                scaled = lora_b.to(self.lora_dtype, copy=True)  # never scale the parameter itself
                if self.scaling != 1:
                    scaled *= self.scaling
                b[0, 0, :, :r] = scaled
            a_stacked.append(a)
            b_stacked.append(b)
        return tuple(a_stacked), tuple(b_stacked)

    def kernel(self, x):
        # The base linear as its own (observable) op: what vLLM's LoRA layer adds the update to.
        out = self.base(x)
        if self.base.engine_rows is not None:
            out = out.index_select(-1, self.base.engine_rows.to(out.device))
        a_stacked, b_stacked = self.derived.get()
        x2 = x.reshape(-1, x.shape[-1])
        wrapper = SteppedPunica(self.mapping.get(x2.shape[0]), self._step)
        y = out.view(-1, out.shape[-1])
        wrapper.add_lora_linear(y, x2, a_stacked, b_stacked, 1.0, tuple(self.out_sizes))
        if self.base.engine_rows is not None:
            out = out.index_select(-1, self.base.trainer_cols.to(out.device))
        return out

    def _step(self, kind: str, run, out):
        return self.steps[kind](run, out)

    def __call__(self, x):
        return _LoRALinearFn.apply(x, self, *self.params)


class _LoRALinearFn(Function):
    @staticmethod
    def forward(ctx, x, op: AlignedLoRALinear, *params):
        ctx.save_for_backward(x, *params)
        ctx.op = op
        return op.kernel(x)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        op = ctx.op
        _, base_weight = op.base.derived.get()
        g2 = g.reshape(-1, g.shape[-1]).float()
        x2 = x.reshape(-1, x.shape[-1]).float()
        gx = g2 @ base_weight.float()  # both in the trainer's row order
        if op.base.engine_rows is not None:
            g2 = g2.index_select(-1, op.base.engine_rows.to(g2.device))  # the slices are vLLM's
        grads = []
        it = iter(params)
        offset = 0
        for pair, size in zip(op.pairs, op.out_sizes):
            gs = g2[:, offset : offset + size]
            offset += size
            if pair is None:
                continue
            a, b = next(it).float(), next(it).float()
            buf = x2 @ a.t()  # [T, r]
            gbuf = (gs @ b) * op.scaling  # [T, r]
            gx = gx + gbuf @ a
            grads.append((gbuf.t() @ x2).to(pair.lora_A.dtype))
            grads.append(((gs.t() @ buf) * op.scaling).to(pair.lora_B.dtype))
        return (gx.reshape(x.shape).to(x.dtype), None, *grads)


def lora_linears(runtime, adapter: LoRAAdapter, base_ops: list[dict], merged=MERGED_TARGETS,
                 mapping: _TokenMapping | None = None) -> list[dict]:
    """The LoRA op of every merged linear an adapter targets, per layer: ``{"qkv": op, ...}``, and
    of the routed experts and shared expert of an MoE layer (``"experts"``, ``"shared_gate_up"``,
    ``"shared_down"``); ``merged``: the model's linears (key of its op) and the checkpoint modules
    stacked in each; ``mapping``: the token mapping to share with other calls (a new one by default)."""
    mapping = mapping or _TokenMapping(runtime)
    if adapter.lora_config.target_parameters:
        from zero_mismatch_plugin.aligned.lora_formats import check_engine_serves_fused_experts

        check_engine_serves_fused_experts(runtime)
    out = []
    for i, ops in enumerate(base_ops):
        layer = {}
        for key, parts in merged.items():
            pairs = [adapter.pair(i, part) for part in parts]
            if all(p is None for p in pairs):
                continue
            if key not in ops:
                raise NotImplementedError(f"layer {i} has no {key} linear for the adapter's {list(parts)}")
            layer[key] = AlignedLoRALinear(runtime, ops[key], pairs, adapter.lora_config, mapping)
        shared = adapter.shared_expert_pairs(i)
        if shared is not None:
            layer["shared_gate_up"] = AlignedLoRALinear(
                runtime, ops["shared_gate_up"], [shared["gate_proj"], shared["up_proj"]], adapter.lora_config, mapping
            )
            layer["shared_down"] = AlignedLoRALinear(
                runtime, ops["shared_down"], [shared["down_proj"]], adapter.lora_config, mapping
            )
        experts = adapter.expert_pairs(i)
        if experts is not None:
            from zero_mismatch_plugin.aligned.moe import AlignedMoELoRA

            layer["experts"] = AlignedMoELoRA(runtime, ops["experts"], experts, adapter.lora_config, mapping)
        out.append(layer)
    return out


def merged_lora_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float):
    """PEFT's merged weight W + s·BA (what ``merge_and_unload`` computes): the forward vLLM does
    not run. Used as the negative control."""
    return weight + scaling * (lora_b @ lora_a)


# ----- embed_tokens and lm_head ------------------------------------------------------------


def _stacked_pair(lora_a, lora_b, max_rank: int, lora_dtype, scaling: float):
    """(A [max_rank, in], B [out, max_rank]) zero-padded to the engine's rank, in the LoRA dtype,
    B cast then scaled (the order of vLLM's ``LoRALayerWeights.optimize``)."""
    a = torch.zeros(max_rank, lora_a.shape[1], dtype=lora_dtype, device=lora_a.device)
    b = torch.zeros(lora_b.shape[0], max_rank, dtype=lora_dtype, device=lora_b.device)
    r = lora_a.shape[0]
    a[:r] = lora_a.to(lora_dtype)
    scaled = lora_b.to(lora_dtype, copy=True)  # never scale the parameter itself
    if scaling != 1:
        scaled *= scaling
    b[:, :r] = scaled
    return a, b


class _VocabLoRA:
    """What the embedding and the logits LoRA ops share: the engine's LoRA settings and the
    trainer's (A, B), re-derived into vLLM's buffers by :meth:`_stacked` after every step."""

    def __init__(self, runtime, pair, lora_config: LoRAConfig, mapping: _TokenMapping):
        lora = _engine_lora_config(runtime, lora_config.r)
        self.runtime = runtime
        self.scaling = lora_config.scaling
        self.max_rank = lora.max_lora_rank
        self.lora_dtype = lora.lora_dtype
        self.mapping = mapping
        self.params = [pair.lora_A, pair.lora_B]
        self.derived = DerivedWeight(self.params, self._build)

    def _stacked(self, sources):
        return _stacked_pair(sources[0], sources[1], self.max_rank, self.lora_dtype, self.scaling)

    def __call__(self, x):
        return _VocabLoRAFn.apply(x, self, *self.params)


class _VocabLoRAFn(Function):
    """The op's forward (vLLM's layer); its ``grads(x, A, B, g)`` (fp32) for the backward."""

    @staticmethod
    def forward(ctx, x, op: _VocabLoRA, lora_a, lora_b):
        ctx.save_for_backward(x, lora_a, lora_b)
        ctx.op = op
        return op.kernel(x)

    @staticmethod
    def backward(ctx, g):
        x, lora_a, lora_b = ctx.saved_tensors
        grad_x, grad_a, grad_b = ctx.op.grads(x, lora_a.float(), lora_b.float(), g.float())
        return grad_x, None, grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype)


class _BaseEmbedding(nn.Module):
    """The frozen embedding lookup as the base layer vLLM's LoRA embedding wraps."""

    def __init__(self, lookup):
        super().__init__()
        self.lookup = lookup

    def forward(self, ids):
        return self.lookup(ids)


class AlignedLoRAEmbedding(_VocabLoRA):
    """vLLM's ``VocabParallelEmbeddingWithLoRA`` (its own forward) over the frozen embedding and
    trainable A [r, vocab], B [hidden, r] (PEFT's ``lora_embedding_A`` / ``_B``): the base rows, plus
    the rows of Aᵀ times B' added by the punica wrapper's ``add_lora_embedding`` in the model dtype.
    Backward in fp32 for A and B only."""

    def __init__(self, runtime, weight, pair, lora_config: LoRAConfig, mapping: _TokenMapping):
        from vllm.lora.layers import VocabParallelEmbeddingWithLoRA

        super().__init__(runtime, pair, lora_config, mapping)
        self.weight = weight
        self.layer = VocabParallelEmbeddingWithLoRA(_BaseEmbedding(self._base))

    def _base(self, ids):
        w = self.weight
        return nn.functional.embedding(ids, w.to(self.runtime.dtype) if w.dtype != self.runtime.dtype else w)

    def _build(self, sources):
        # vLLM's buffers: A transposed, one row per token id ([vocab, max_rank]), B [1, 1, hidden, max_rank].
        a, b = self._stacked(sources)
        return a.t().contiguous(), b[None, None]

    def kernel(self, ids):
        self.layer.lora_a_stacked_2d, self.layer.lora_b_stacked = self.derived.get()
        self.layer.punica_wrapper = self.mapping.get(ids.shape[0])
        return self.layer(ids)

    def grads(self, ids, a, b, g):
        """out = base[ids] + s (Aᵀ[ids]) Bᵀ: no gradient for the ids, A's columns at the ids."""
        g2 = g.reshape(-1, g.shape[-1])
        rows = a.t().index_select(0, ids)  # [T, r]: the A rows of the tokens
        grad_rows = (g2 @ b) * self.scaling  # [T, r]
        grad_a = torch.zeros_like(a).index_add_(1, ids, grad_rows.t())
        return None, grad_a, (g2.t() @ rows) * self.scaling


class AlignedLoRALogits(_VocabLoRA):
    """vLLM's ``LogitsProcessorWithLoRA`` (its own forward) over the frozen head of
    :class:`~.ops.AlignedLogits` and trainable A [r, hidden], B [vocab, r]: the head's logits, then
    ``add_lora_logits`` (buf = h Aᵀ in fp32, logits += buf B'ᵀ), then soft-cap and scale. Backward
    in fp32 for A and B (and the hidden states), none for the frozen head."""

    def __init__(self, runtime, head, pair, lora_config: LoRAConfig, mapping: _TokenMapping):
        from vllm.lora.layers import LogitsProcessorWithLoRA

        super().__init__(runtime, pair, lora_config, mapping)
        self.head = head
        # The trainer is one process with no tensor-parallel group: vLLM's layer, built without its
        # __init__ (which asks that group for its size), holds what that __init__ sets for a world
        # of 1, and its processor's gather is the identity (what vLLM's gather does at world size 1).
        processor = runtime.logits_processor(head.vocab_size)
        processor._gather_logits = lambda logits: logits
        layer = LogitsProcessorWithLoRA.__new__(LogitsProcessorWithLoRA)
        nn.Module.__init__(layer)
        layer.base_layer = processor
        layer.hidden_size, layer.dtype, layer.device = head.weight.shape[1], runtime.dtype, head.weight.device
        layer.tp_size, layer.tp_rank = 1, 0
        layer.sharded_to_full_mapping = layer.sharded_to_full_mapping_gpu = None
        self.layer = layer

    def _build(self, sources):
        # vLLM's buffers: A [1, 1, max_rank, hidden], B [1, 1, vocab, max_rank].
        return tuple(t[None, None] for t in self._stacked(sources))

    def kernel(self, hidden):
        self.layer.lora_a_stacked, self.layer.lora_b_stacked = self.derived.get()
        self.layer.punica_wrapper = self.mapping.get(hidden.shape[0])
        return self.layer(self.head.derived.get(), hidden)

    def grads(self, hidden, a, b, g):
        """logits = h Wᵀ + s (h Aᵀ) Bᵀ (no soft-cap, no scale): the hidden states' gradient too."""
        if self.layer.soft_cap is not None or self.layer.scale != 1.0:
            raise NotImplementedError("logit soft-capping / scaling has no aligned backward yet")
        h32 = hidden.float()
        w32 = self.head.weight.detach().to(self.runtime.dtype).float()
        gbuf = (g @ b) * self.scaling  # [R, r]
        grad_hidden = g @ w32 + gbuf @ a
        return grad_hidden.to(hidden.dtype), gbuf.t() @ h32, (g.t() @ (h32 @ a.t())) * self.scaling


def lora_vocab_ops(runtime, adapter: LoRAAdapter, embed_weight, head) -> dict:
    """``{"embed_tokens": AlignedLoRAEmbedding, "lm_head": AlignedLoRALogits}`` for the vocabulary
    targets the adapter has (none: empty)."""
    ops = {}
    pair = adapter.vocab_pair("embed_tokens")
    if pair is not None:
        ops["embed_tokens"] = AlignedLoRAEmbedding(runtime, embed_weight, pair, adapter.lora_config, _TokenMapping(runtime))
    pair = adapter.vocab_pair("lm_head")
    if pair is not None:
        ops["lm_head"] = AlignedLoRALogits(runtime, head, pair, adapter.lora_config, _TokenMapping(runtime, sampled_rows=True))
    return ops
