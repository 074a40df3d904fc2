"""The checkpoint architectures the aligned trainer forward supports, and what their blocks are.

One entry per architecture, read by both faces (the aligned model and the Megatron spec), the
checker and the config checks. :func:`describe` reads a checkpoint's config once into
:class:`Blocks`; every face builds its layers from that, so adding an architecture is one entry
here (plus the ops it needs). Light on purpose: the CLI and the config checks import it without
torch, vLLM or megatron-core.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable


@dataclass(frozen=True)
class Blocks:
    """What every decoder layer of a checkpoint is made of (the supported dense decoders)."""

    architecture: str
    norm: str  # "rms": RMSNorm before attention, before the MLP and at the end
    attention: str  # "causal": full causal self-attention, grouped-query
    qk_norm: bool  # an RMSNorm on every q and k head before the rotary embedding
    mlp: str  # "swiglu": gate_up linear, SiluAndMul, down linear, no bias
    rope_type: str  # vLLM's rope_type ("default": plain rotary at rope_theta)
    rope_theta: float | None
    qkv_bias: bool
    o_bias: bool
    tied_head: bool  # the lm_head is the token embedding
    head_dim: int
    # Per layer: the sliding window vLLM gives that layer's attention (each query sees itself and
    # the window - 1 tokens before it), None for full causal attention. Empty: no layer is windowed.
    sliding_windows: tuple[int | None, ...] = ()

    def window_of(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Entry:
    qk_norm: bool
    biases: Callable[[object], tuple[bool, bool]]  # config -> (qkv_bias, o_bias), as vLLM reads them
    refuse: Callable[[object], list[str]] = lambda config: []  # what of this family vLLM does not run plainly
    # Whether a model-level ``sliding_window`` means the same thing to vLLM and transformers here
    # (every layer windowed); families without it keep refusing windowed configs.
    every_layer_window: bool = False


def _llama_biases(config) -> tuple[bool, bool]:
    # vLLM's Llama: attention_bias (or bias) puts a bias on q/k/v and o_proj; qkv_bias overrides q/k/v.
    bias = bool(getattr(config, "attention_bias", False) or getattr(config, "bias", False))
    return bool(getattr(config, "qkv_bias", bias)), bias


def _mistral_extras(config) -> list[str]:
    out = []
    if getattr(config, "llama_4_scaling", None) is not None:
        out.append("llama_4_scaling (position-dependent query scaling): set it to null")
    if getattr(config, "ada_rms_norm_t_cond", False):
        out.append("ada_rms_norm_t_cond (time-conditioned norms): set it to false")
    return out


_ENTRIES: dict[str, _Entry] = {
    "LlamaForCausalLM": _Entry(qk_norm=False, biases=_llama_biases),
    "Qwen2ForCausalLM": _Entry(qk_norm=False, biases=lambda config: (True, False)),
    "Qwen3ForCausalLM": _Entry(
        qk_norm=True, biases=lambda config: (bool(getattr(config, "attention_bias", False)), False)
    ),
    "MistralForCausalLM": _Entry(
        qk_norm=False, biases=_llama_biases, refuse=_mistral_extras, every_layer_window=True
    ),
}

SUPPORTED_ARCHITECTURES = tuple(_ENTRIES)

# The linears the aligned LoRA path adapts (vLLM's dense LoRA layers), under the checkpoint's names
# and, for a verl Megatron config, under megatron-core's names of the same (merged) linears.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEGATRON_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def architecture_of(config) -> str:
    """The checkpoint's architecture name, refused clearly if no entry covers it."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch not in _ENTRIES:
        raise NotImplementedError(
            f"architecture {arch!r} is not supported by the aligned trainer forward; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _layer_windows(config, entry: _Entry) -> tuple[tuple[int | None, ...], list[str]]:
    """(the window of every layer, what is refused). vLLM's Llama-family attention windows a
    layer by ``layer_types`` when the config has them, else every layer by ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        # transformers' Mistral ignores layer_types (it windows every layer) while vLLM follows
        # them, and vLLM's Qwen2/Qwen3 refuse a mix: no family here reads them the same way.
        return (), ["sliding-window layers (layer_types other than full_attention)"]
    if window is None:
        return (), []
    if not entry.every_layer_window:
        return (), [f"sliding_window={window} (windowed attention): set it to null"]
    if not isinstance(window, int) or window < 1:
        return (), [f"sliding_window={window!r}: a positive number of tokens (or null)"]
    return (window,) * config.num_hidden_layers, []


def windows_every_layer(architecture: str | None, layer_types=None) -> bool:
    """Whether a model-level ``sliding_window`` of ``architecture`` is a window on every layer that
    both faces cover (no ``layer_types`` other than full_attention)."""
    entry = _ENTRIES.get(architecture or "")
    mixed = any(t != "full_attention" for t in (layer_types or []))
    return bool(entry and entry.every_layer_window and not mixed)


def _unsupported_features(config) -> list[str]:
    out = []
    if getattr(config, "hidden_act", "silu") != "silu":
        out.append(f"hidden_act={config.hidden_act!r}: only SwiGLU (silu) MLPs")
    if getattr(config, "mlp_bias", False):
        out.append("mlp_bias: set it to false")
    if not getattr(config, "is_causal", True):
        out.append("a non-causal model: only causal decoders")
    return out


def describe(config) -> Blocks:
    """The blocks of the checkpoint whose (transformers) config is ``config``; raises
    ``NotImplementedError`` naming every setting the aligned forward does not cover."""
    arch = architecture_of(config)
    entry = _ENTRIES[arch]
    windows, window_problems = _layer_windows(config, entry)
    problems = window_problems + _unsupported_features(config) + entry.refuse(config)
    if problems:
        raise NotImplementedError(f"{arch}: not supported by the aligned trainer forward: " + "; ".join(problems))
    qkv_bias, o_bias = entry.biases(config)
    rope = getattr(config, "rope_parameters", None) or {}
    return Blocks(
        architecture=arch,
        norm="rms",
        attention="causal",
        qk_norm=entry.qk_norm,
        mlp="swiglu",
        rope_type=rope.get("rope_type") or "default",
        rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", None)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        tied_head=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        sliding_windows=windows,
    )
