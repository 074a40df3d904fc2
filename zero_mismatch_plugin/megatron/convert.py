"""Dense checkpoints of :mod:`zero_mismatch_plugin.architectures` <-> megatron-core GPTModel (TP=1).

Layouts that differ between the Hugging Face / vLLM checkpoint and megatron-core:

* ``linear_qkv``: megatron interleaves per query group ``[q heads of the group; k; v]``; the
  checkpoint has separate ``q_proj``, ``k_proj``, ``v_proj`` (vLLM stacks them ``[q; k; v]``).
* ``linear_fc1``: ``[gate; up]`` in megatron, the same order as vLLM's ``gate_up_proj``.
* separate norms (local spec): ``input_layernorm`` / ``pre_mlp_layernorm`` / ``final_layernorm``.

Used to load the checkpoint the engine serves into a megatron model (standalone use and tests;
verl loads through Megatron-Bridge) and to send a megatron model's weights back to the engine.
"""

from __future__ import annotations

import os

import torch

from ..aligned.checkpoint import copy_checkpoint, read_checkpoint
from ..architectures import Blocks, describe


def megatron_blocks(hf_config) -> Blocks:
    """The checkpoint's blocks, refused where megatron-core's dense GPT layer cannot hold them."""
    blocks = describe(hf_config)
    if blocks.moe is not None:
        raise NotImplementedError(
            f"{blocks.architecture}: Mixture-of-Experts layers are not in the Megatron face yet; "
            "use the aligned trainer model (AlignedCausalLM)"
        )
    if blocks.partial_rotary_factor != 1.0:
        raise NotImplementedError(
            f"{blocks.architecture}: partial rotary (factor {blocks.partial_rotary_factor}) is not "
            "supported by the Megatron face"
        )
    if blocks.o_bias:
        # megatron-core has one switch (add_bias_linear) for o_proj and both MLP linears.
        raise NotImplementedError(
            f"{blocks.architecture}: an o_proj bias (attention_bias=true) is not supported by the "
            "Megatron face: megatron-core cannot bias o_proj alone; use the aligned trainer model"
        )
    if blocks.rope_type != "default":
        raise NotImplementedError(f"rope scaling {blocks.rope_type!r} is not supported by the Megatron face")
    if blocks.rope_theta is None:
        raise ValueError("checkpoint config has no rope_theta")
    return blocks


# vLLM runs none of megatron-core's fused kernels: each op is the op layer's, so every fusion is off.
_UNFUSED = dict.fromkeys(("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                          "masked_softmax_fusion", "apply_rope_fusion", "persist_layer_norm"), False)


def transformer_config_from_hf(hf_config, params_dtype=torch.float32, **overrides):
    """A megatron-core ``TransformerConfig`` for a supported dense checkpoint (CPU-friendly)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    blocks = megatron_blocks(hf_config)
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        kv_channels=blocks.head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=blocks.qkv_bias,
        qk_layernorm=blocks.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        **_UNFUSED,
    )
    kwargs.update(megatron_windows(blocks))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def megatron_windows(blocks: Blocks) -> dict:
    """megatron-core's ``window_size`` / ``window_attn_skip_freq`` for the checkpoint's per-layer
    sliding windows (vLLM's window W is megatron's causal ``(W - 1, 0)``)."""
    windows = [w for w in blocks.sliding_windows if w is not None]
    if not windows:
        return {}
    if len(set(windows)) != 1:
        raise NotImplementedError(f"layers with different sliding windows {sorted(set(windows))}")
    out = {"window_size": (windows[0] - 1, 0)}
    if None in blocks.sliding_windows:
        # A list marks the windowed layers (1) and the full-attention ones (0), layer by layer.
        out["window_attn_skip_freq"] = [int(w is not None) for w in blocks.sliding_windows]
    return out


def gpt_model_kwargs(hf_config) -> dict:
    blocks = megatron_blocks(hf_config)
    return dict(
        vocab_size=hf_config.vocab_size,
        max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
        share_embeddings_and_output_weights=blocks.tied_head,
        position_embedding_type="rope",
        rotary_base=float(blocks.rope_theta),
    )


# ----- weight layouts ----------------------------------------------------------------------


def _groups(hf_config):
    nh, ng, d = hf_config.num_attention_heads, hf_config.num_key_value_heads, describe(hf_config).head_dim
    return nh, ng, d


def fuse_qkv(q, k, v, hf_config):
    """[q; k; v] checkpoint tensors (weight or bias) -> megatron's per-group interleaved qkv."""
    nh, ng, d = _groups(hf_config)
    per = nh // ng
    rest = q.shape[1:]
    q = q.reshape(ng, per * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (per + 2) * d, *rest)


def split_qkv(qkv, hf_config):
    """megatron's interleaved qkv -> (q, k, v) in the checkpoint's layout."""
    nh, ng, d = _groups(hf_config)
    per = nh // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(nh * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def hf_to_megatron(state: dict, hf_config) -> dict:
    """Checkpoint state dict (HF names) -> GPTModel state dict (megatron names)."""
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"]}
    blocks = megatron_blocks(hf_config)
    has_bias, qk_norm = blocks.qkv_bias, blocks.qk_norm
    for i in range(hf_config.num_hidden_layers):
        src = f"model.layers.{i}."
        dst = f"decoder.layers.{i}."
        a = src + "self_attn."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"], hf_config
        )
        if has_bias:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                state[a + "q_proj.bias"], state[a + "k_proj.bias"], state[a + "v_proj.bias"], hf_config
            )
        if qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = state[a + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = state[a + "k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = state[a + "o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = state[src + "post_attention_layernorm.weight"]
        m = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [state[m + "gate_proj.weight"], state[m + "up_proj.weight"]], dim=0
        )
        out[dst + "mlp.linear_fc2.weight"] = state[m + "down_proj.weight"]
    out["decoder.final_layernorm.weight"] = state["model.norm.weight"]
    if not blocks.tied_head:
        out["output_layer.weight"] = state["lm_head.weight"]
    return out


def megatron_to_hf(state: dict, hf_config) -> dict:
    """GPTModel state dict (or gradients under the same names) -> checkpoint names/layouts."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    blocks = megatron_blocks(hf_config)
    has_bias, qk_norm = blocks.qkv_bias, blocks.qk_norm
    inter = hf_config.intermediate_size
    for i in range(hf_config.num_hidden_layers):
        src = f"decoder.layers.{i}."
        dst = f"model.layers.{i}."
        a = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        q, k, v = split_qkv(state[src + "self_attention.linear_qkv.weight"], hf_config)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if has_bias:
            q, k, v = split_qkv(state[src + "self_attention.linear_qkv.bias"], hf_config)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        if qk_norm:
            out[a + "q_norm.weight"] = state[src + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = state[src + "self_attention.k_layernorm.weight"]
        out[a + "o_proj.weight"] = state[src + "self_attention.linear_proj.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        gate, up = state[src + "mlp.linear_fc1.weight"].split([inter, inter], dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
        out[dst + "mlp.down_proj.weight"] = state[src + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if "output_layer.weight" in state:
        out["lm_head.weight"] = state["output_layer.weight"]
    return out


def load_hf_checkpoint(model, model_dir: str | os.PathLike, hf_config) -> None:
    """Copy the checkpoint in ``model_dir`` into a GPTModel (in place, exact names checked)."""
    mapped = hf_to_megatron(read_checkpoint(model_dir), hf_config)
    copy_checkpoint(dict(model.named_parameters()), mapped)


def engine_weights(model, hf_config, dtype) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor in the engine dtype) for every weight of a GPTModel."""
    state = {k: p.detach() for k, p in model.named_parameters()}
    return [(k, v.to(dtype)) for k, v in megatron_to_hf(state, hf_config).items()]


def sync_weights_to_engine(llm, model, hf_config, dtype) -> None:
    """Send a GPTModel's weights into a ``vllm.LLM`` through vLLM's own loading path."""
    from ..aligned.weight_sync import load_named_weights

    load_named_weights(llm, engine_weights(model, hf_config, dtype))


# ----- LoRA adapters -----------------------------------------------------------------------

# The megatron linear holding each LoRA target, and vLLM's output slices of that linear in order.
MEGATRON_LORA_SLICES = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
_LORA_MODULE = {target: module for module, targets in MEGATRON_LORA_SLICES.items() for target in targets}


def megatron_lora_name(layer: int, target: str, which: str) -> str:
    """The Megatron face's name of the A or B matrix of PEFT target ``target`` in ``layer``.

    The adapter keeps vLLM's per-slice matrices (q, k, v each have their own A and B, in the
    checkpoint's row order): vLLM applies them slice by slice, so a fused megatron-layout adapter
    could not be served.
    """
    return f"decoder.layers.{layer}.{_LORA_MODULE[target]}.lora.{target}.lora_{which}"


def peft_to_megatron_lora(state: dict) -> dict:
    """PEFT adapter tensors (``base_model.model.model.layers.{i}...lora_A.weight``) -> the
    Megatron face's adapter parameter names; the tensors themselves are unchanged."""
    from ..aligned.lora import parse_peft_tensor_name

    out = {}
    for name, tensor in state.items():
        layer, target, which = parse_peft_tensor_name(name)
        out[megatron_lora_name(layer, target, which)] = tensor
    return out


def megatron_to_peft_lora(state: dict) -> dict:
    """The Megatron face's adapter parameters (or their gradients) -> PEFT names."""
    from ..aligned.lora import peft_tensor_name

    out = {}
    for name, tensor in state.items():
        head, target, which = name.rsplit(".", 2)
        layer = int(head.split(".")[2])
        if _LORA_MODULE.get(target) is None or megatron_lora_name(layer, target, which[-1]) != name:
            raise ValueError(f"{name}: not a Megatron-face LoRA parameter name")
        out[peft_tensor_name(layer, target, which[-1])] = tensor
    return out
