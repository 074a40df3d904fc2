"""Checkpoints of :mod:`zero_mismatch_plugin.tables.architectures` <-> megatron-core GPTModel (any TP, EP=1).

Loads the checkpoint the engine serves into a megatron model (standalone use and tests; verl loads
through Megatron-Bridge) and sends a megatron model's weights back to the engine; the layouts that
differ (grouped qkv, ``[gate; up]`` fc1, MoE names): docs/megatron.md.
"""

from __future__ import annotations

import os
import re

import torch

from zero_mismatch_plugin.aligned.checkpoint import copy_checkpoint, read_checkpoint
from zero_mismatch_plugin.faces.megatron import parallel, pipeline
from zero_mismatch_plugin.tables.architectures import MOE_CHECKPOINT_NAMES, Blocks, describe


def megatron_blocks(hf_config) -> Blocks:
    """The checkpoint's blocks, refused where megatron-core's GPT layer cannot hold them."""
    blocks = describe(hf_config)
    if getattr(hf_config, "kv_lora_rank", None) is not None:
        raise NotImplementedError(
            f"{blocks.architecture}: multi-latent attention (MLA) is not supported by the Megatron face; "
            "use the aligned trainer model (zmrl check --trainer aligned)")
    if blocks.linear_attention is not None:
        # megatron-core 0.16's gated delta-net is its own layer spec (ssm/gated_delta_net.py) with
        # its own kernels; the face's GPT layer spec has no slot for vLLM's linear-attention op.
        raise NotImplementedError(
            f"{blocks.architecture}: {blocks.aligned_model_only()} is not supported by the Megatron face; "
            "use the aligned trainer model (zmrl check --trainer aligned)")
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
        pipeline_dtype=params_dtype,  # what stages send each other (read only at pipeline parallelism > 1)
        batch_p2p_sync=torch.cuda.is_available(),  # a device synchronize after the stages' sends and receives
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        **_UNFUSED,
    )
    kwargs.update(megatron_windows(blocks))
    kwargs.update(megatron_moe(blocks, hf_config.num_hidden_layers))
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


def vllm_window(window_size) -> int | None:
    """vLLM's ``sliding_window`` (tokens a query sees, itself included) for megatron-core's causal
    ``window_size=(left, 0)``; ``None`` for anything else."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        return None
    if isinstance(left, int) and left >= 0 and right == 0:
        return left + 1
    return None


def megatron_moe(blocks: Blocks, num_layers: int) -> dict:
    """megatron-core's MoE settings for the checkpoint's Mixture-of-Experts layers ({} if none).

    They describe the layers; the aligned MoE layer computes them with vLLM's router and experts
    (:class:`.moe.AlignedMoELayer`), so megatron's own load balancing, aux losses and
    expert-bias updates are off.
    """
    moe = blocks.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.moe_intermediate_size,
        moe_layer_freq=[int(blocks.mlp_kind(i) == "moe") for i in range(num_layers)],
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_score_function=moe.scoring_func,
        # Softmax routing without renormalization is megatron's softmax before the top-k.
        moe_router_pre_softmax=moe.scoring_func == "softmax" and not moe.norm_topk_prob,
        moe_router_num_groups=moe.n_group if moe.grouped_topk else None,
        moe_router_group_topk=moe.topk_group if moe.grouped_topk else None,
        moe_router_topk_scaling_factor=moe.routed_scaling_factor if moe.routed_scaling_factor != 1.0 else None,
        moe_router_enable_expert_bias=moe.e_score_correction_bias,
        moe_router_bias_update_rate=0.0,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
    )


def gpt_model_kwargs(hf_config) -> dict:
    blocks = megatron_blocks(hf_config)
    return dict(
        vocab_size=hf_config.vocab_size,
        max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
        share_embeddings_and_output_weights=blocks.tied_head,
        position_embedding_type="rope",
        rotary_base=float(blocks.rope_theta),
        rotary_percent=blocks.partial_rotary_factor,
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


def _mlp_pairs(blocks: Blocks, layer: int, src: str, dst: str) -> list[tuple[str, tuple[str, ...]]]:
    """(megatron name, checkpoint names) of one layer's MLP; several checkpoint names are stacked
    along rows in megatron (``linear_fc1`` = [gate; up], equal halves)."""
    if blocks.mlp_kind(layer) == "dense":
        m = src + "mlp."
        return [
            (dst + "mlp.linear_fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight")),
            (dst + "mlp.linear_fc2.weight", (m + "down_proj.weight",)),
        ]
    moe = blocks.moe
    block, gate, (g, u, d), shared = MOE_CHECKPOINT_NAMES[moe.names]
    b, m = f"{src}{block}.", dst + "mlp."
    pairs = [(m + "router.weight", (f"{b}{gate}.weight",))]
    if moe.e_score_correction_bias:
        pairs.append((m + "router.expert_bias", (f"{b}{gate}.e_score_correction_bias",)))
    for e in range(moe.num_experts):
        expert, local = f"{b}experts.{e}.", f"{m}experts.local_experts.{e}."
        pairs.append((local + "linear_fc1.weight", (f"{expert}{g}.weight", f"{expert}{u}.weight")))
        pairs.append((local + "linear_fc2.weight", (f"{expert}{d}.weight",)))
    if moe.shared_expert_intermediate_size:
        s = f"{b}{shared}."
        pairs.append((m + "shared_experts.linear_fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight")))
        pairs.append((m + "shared_experts.linear_fc2.weight", (s + "down_proj.weight",)))
        if moe.shared_expert_gate:
            pairs.append((m + "shared_experts.gate_weight", (f"{b}shared_expert_gate.weight",)))
    return pairs


def _pairs(blocks: Blocks, num_layers: int) -> list[tuple[str, tuple[str, ...]]]:
    """(megatron name, checkpoint names) of every tensor but the fused qkv."""
    pairs = [("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, sa = src + "self_attn.", dst + "self_attention."
        pairs.append((dst + "input_layernorm.weight", (src + "input_layernorm.weight",)))
        if blocks.qk_norm:
            pairs.append((sa + "q_layernorm.weight", (a + "q_norm.weight",)))
            pairs.append((sa + "k_layernorm.weight", (a + "k_norm.weight",)))
        pairs.append((sa + "linear_proj.weight", (a + "o_proj.weight",)))
        pairs.append((dst + "pre_mlp_layernorm.weight", (src + "post_attention_layernorm.weight",)))
        pairs += _mlp_pairs(blocks, i, src, dst)
    pairs.append(("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not blocks.tied_head:
        pairs.append(("output_layer.weight", ("lm_head.weight",)))
    return pairs


def _qkv_kinds(blocks: Blocks) -> tuple[str, ...]:
    return ("weight", "bias") if blocks.qkv_bias else ("weight",)


def hf_to_megatron(state: dict, hf_config) -> dict:
    """Checkpoint state dict (HF names) -> GPTModel state dict (megatron names)."""
    blocks = megatron_blocks(hf_config)
    out = {
        dst: state[srcs[0]] if len(srcs) == 1 else torch.cat([state[n] for n in srcs], dim=0)
        for dst, srcs in _pairs(blocks, hf_config.num_hidden_layers)
    }
    for i in range(hf_config.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        for kind in _qkv_kinds(blocks):
            out[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = fuse_qkv(
                state[f"{a}q_proj.{kind}"], state[f"{a}k_proj.{kind}"], state[f"{a}v_proj.{kind}"], hf_config
            )
    return out


def megatron_to_hf(state: dict, hf_config) -> dict:
    """GPTModel state dict (or gradients under the same names) -> checkpoint names/layouts.

    Names missing from ``state`` are skipped (a tied head has no ``output_layer.weight``; a
    gradient dict has no buffer such as the router's ``expert_bias``)."""
    blocks = megatron_blocks(hf_config)
    out = {}
    for src, dsts in _pairs(blocks, hf_config.num_hidden_layers):
        if src in state:
            out.update(zip(dsts, state[src].chunk(len(dsts), dim=0)))
    for i in range(hf_config.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        for kind in _qkv_kinds(blocks):
            q, k, v = split_qkv(state[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"], hf_config)
            out[f"{a}q_proj.{kind}"], out[f"{a}k_proj.{kind}"], out[f"{a}v_proj.{kind}"] = q, k, v
    return out


def model_tensors(model) -> dict:
    """A GPTModel's parameters and the persistent buffers a checkpoint holds (the router's
    ``expert_bias``), by megatron name."""
    tensors = dict(model.named_parameters())
    tensors.update((name, b) for name, b in model.named_buffers() if name.endswith("router.expert_bias"))
    return tensors


def _tensor_parallel_group(model):
    return parallel.tensor_parallel_group(getattr(model, "config", None))


def load_hf_checkpoint(model, model_dir: str | os.PathLike, hf_config) -> None:
    """Copy the checkpoint in ``model_dir`` into a GPTModel (in place, exact names checked); under
    tensor parallelism each rank takes its part (:func:`.parallel.shard`)."""
    mapped = hf_to_megatron(read_checkpoint(model_dir), hf_config)
    group = _tensor_parallel_group(model)
    config = getattr(model, "config", None)
    if group is not None:
        rank, size, split = parallel.group_rank(group), parallel.group_size(group), parallel.experts_split(config)
        mapped = {name: parallel.shard(name, full, rank, size, split) for name, full in mapped.items()}
    mapped = parallel.local_experts_of(mapped, getattr(config, "num_moe_experts", None) or 0,
                                       parallel.expert_parallel_group(config))
    mapped = pipeline.to_stage(mapped, config, megatron_blocks(hf_config).tied_head, getattr(model, "vp_stage", None))
    copy_checkpoint(model_tensors(model), mapped)


def engine_weights(model, hf_config, dtype) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor in the engine dtype) for every weight of a GPTModel (with virtual
    pipeline stages, the rank's list of model chunks); under tensor, expert or pipeline parallelism
    the full tensors, gathered from every rank (a collective: all ranks call it)."""
    tensors = [model_tensors(chunk) for chunk in model] if isinstance(model, list) else model_tensors(model)
    return [(k, v.to(dtype)) for k, v in megatron_to_hf(full_tensors(model, tensors), hf_config).items()]


def full_tensors(model, tensors) -> dict:
    """Full tensors by megatron name (every routed expert and layer under its global number) from
    this rank's parts of ``tensors`` (the model's parameters, or their gradients): gathered over
    the tensor-, expert- and pipeline-parallel ranks (collectives: all ranks call it). With virtual
    pipeline stages ``model`` is the rank's list of model chunks and ``tensors`` one dict per chunk."""
    chunked = isinstance(model, list)
    config = pipeline.model_config(model)
    group, split = parallel.tensor_parallel_group(config), parallel.experts_split(config)
    experts, experts_group = getattr(config, "num_moe_experts", None) or 0, parallel.expert_parallel_group(config)
    gathered = [parallel.gather_experts({k: parallel.gather_full(k, t.detach(), group, split) for k, t in part.items()},
                                        experts, experts_group)
                for part in (tensors if chunked else [tensors])]
    tied = getattr(model[0] if chunked else model, "share_embeddings_and_output_weights", False)
    return pipeline.gather_stages(gathered if chunked else gathered[0], config, tied)


def sync_weights_to_engine(llm, model, hf_config, dtype) -> None:
    """Send a GPTModel's weights into a ``vllm.LLM`` through vLLM's own loading path."""
    from zero_mismatch_plugin.aligned.weight_sync import load_named_weights

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
# In an MoE layer the MLP targets are those of each routed expert (``expert`` its index) and of
# the shared expert (``expert`` = SHARED_EXPERT), each an MLP of megatron's fc1 / fc2 layout.
SHARED_EXPERT = "shared"
_MEGATRON_LORA_NAME = re.compile(
    r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(?:experts\.local_experts\.(\d+)\.|(shared_experts)\.)?"
    r"linear_\w+\.lora\.(\w+)\.lora_(A|B)$"
)
# The megatron module holding each vocabulary adapter (PEFT's embed_tokens / lm_head).
MEGATRON_VOCAB_LORA_MODULES = {"embed_tokens": "embedding.word_embeddings", "lm_head": "output_layer"}


def lora_slices(target: str) -> tuple[str, ...]:
    """vLLM's output slices (PEFT targets, in order) of the megatron linear holding ``target``."""
    return MEGATRON_LORA_SLICES[_LORA_MODULE[target]]


def lora_linear_name(layer: int, target: str, expert: int | str | None = None) -> str:
    """The megatron linear holding PEFT target ``target`` of ``layer``: the layer's own, or with
    ``expert`` that of routed expert ``expert`` (or of the shared expert, ``SHARED_EXPERT``)."""
    module = _LORA_MODULE[target]
    if expert is None:
        return f"decoder.layers.{layer}.{module}"
    if module not in ("mlp.linear_fc1", "mlp.linear_fc2"):
        raise ValueError(f"{target}: not an MLP target, an expert has none")
    owner = "shared_experts" if expert == SHARED_EXPERT else f"experts.local_experts.{int(expert)}"
    return f"decoder.layers.{layer}.mlp.{owner}.{module.split('.')[1]}"


def megatron_lora_name(layer: int, target: str, which: str, expert: int | str | None = None) -> str:
    """The Megatron face's name of the A or B matrix of PEFT target ``target`` in ``layer`` (of
    routed expert ``expert``, or of the shared expert: see :func:`lora_linear_name`).

    The adapter keeps vLLM's per-slice matrices (q, k, v each have their own A and B, in the
    checkpoint's row order): vLLM applies them slice by slice, so a fused megatron-layout adapter
    could not be served.
    """
    return f"{lora_linear_name(layer, target, expert)}.lora.{target}.lora_{which}"


def megatron_vocab_lora_name(target: str, which: str) -> str:
    """The Megatron face's name of the A or B matrix of vocabulary target ``target``
    (``embed_tokens`` / ``lm_head``), on the megatron module that computes it."""
    return f"{MEGATRON_VOCAB_LORA_MODULES[target]}.lora.{target}.lora_{which}"


def _vocab_lora_names() -> dict[str, str]:
    """{PEFT name: Megatron-face name} of the vocabulary adapters' A and B."""
    from zero_mismatch_plugin.aligned.lora.names import PEFT_VOCAB_NAMES

    return {peft: megatron_vocab_lora_name(target, which)
            for target, names in PEFT_VOCAB_NAMES.items() for peft, which in zip(names, "AB")}


def parse_megatron_lora_name(name: str) -> tuple[int, str, str, int | str | None]:
    """(layer, target, "A" | "B", expert) of a Megatron-face adapter parameter name (the inverse
    of :func:`megatron_lora_name`); other names are refused."""
    match = _MEGATRON_LORA_NAME.match(name)
    parsed = None
    if match is not None and match.group(4) in _LORA_MODULE:
        expert = SHARED_EXPERT if match.group(3) else None if match.group(2) is None else int(match.group(2))
        parsed = int(match.group(1)), match.group(4), match.group(5), expert
    if parsed is None or megatron_lora_name(parsed[0], parsed[1], parsed[2], parsed[3]) != name:
        raise ValueError(f"{name}: not a Megatron-face LoRA parameter name")
    return parsed


def peft_to_megatron_lora(state: dict) -> dict:
    """PEFT adapter tensors (``base_model.model.model.layers.{i}...lora_A.weight``, routed experts'
    ``mlp.experts.{e}.gate_proj`` ..., the shared expert's, embed_tokens' and lm_head's) -> the Megatron face's adapter
    parameter names; the tensors themselves are unchanged."""
    from zero_mismatch_plugin.aligned.lora.names import parse_peft_expert_tensor_name, parse_peft_tensor_name

    vocab = _vocab_lora_names()
    out = {}
    for name, tensor in state.items():
        if name in vocab:
            out[vocab[name]] = tensor
            continue
        parsed = parse_peft_expert_tensor_name(name)
        if parsed is None:
            layer, target, which = parse_peft_tensor_name(name)
            expert = None
        else:
            layer, expert, target, which = parsed
            expert = SHARED_EXPERT if expert is None else expert
        out[megatron_lora_name(layer, target, which, expert)] = tensor
    return out


def megatron_to_peft_lora(state: dict, hf_config=None) -> dict:
    """The Megatron face's adapter parameters (or their gradients) -> PEFT names. ``hf_config``:
    the checkpoint's config, which names the experts' modules (needed only for an adapter on
    experts)."""
    from zero_mismatch_plugin.aligned.lora.names import (
        peft_expert_module_name,
        peft_shared_expert_module_name,
        peft_tensor_name,
    )

    vocab = {megatron: peft for peft, megatron in _vocab_lora_names().items()}
    out = {}
    for name, tensor in state.items():
        if name in vocab:
            out[vocab[name]] = tensor
            continue
        layer, target, which, expert = parse_megatron_lora_name(name)
        if expert is None:
            out[peft_tensor_name(layer, target, which)] = tensor
            continue
        if hf_config is None:
            raise ValueError(f"{name}: pass the checkpoint's hf_config to name its experts' modules")
        if expert == SHARED_EXPERT:
            module = peft_shared_expert_module_name(layer, MOE_CHECKPOINT_NAMES[describe(hf_config).moe.names][3], target)
        else:
            module = peft_expert_module_name(layer, expert, target, hf_config)
        out[f"{module}.lora_{which}.weight"] = tensor
    return out
