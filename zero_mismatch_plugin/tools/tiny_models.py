"""Tiny randomly initialised checkpoints with a local tokenizer, built without hub access.

Dense Llama, Mistral, Qwen2, Qwen3 and CWM, Mixture-of-Experts Qwen3-MoE, Qwen2-MoE, Mixtral and
GLM-4.5 shapes, and DeepSeek-V2/V3 (MLA): a byte-level BPE tokenizer trained on a generated corpus
and a random model, saved with ``save_pretrained`` for vLLM, transformers and the aligned trainer.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "cwm", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")

# Shapes chosen so vLLM's CPU attention accepts them (head_dim in 32/64/80/96/112/128/...)
# and some GEMMs have K >= 256, where torch's and oneDNN's CPU GEMMs round differently.
DEFAULT_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)

# Mixture-of-Experts families: 8 experts, top-2, expert width 96 (a multiple of 32, which vLLM's CPU
# experts need; another width, e.g. moe_intermediate_size=80, is zero-padded by vLLM to 96).
MOE_SHAPE = dict(num_experts=8, top_k=2, moe_intermediate_size=96, shared_expert_intermediate_size=96)

_SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]

_WORDS = (
    "the a one two three four five six seven eight nine ten plus minus times equals answer "
    "question reason step first then next finally because so therefore number sum product "
    "apple river stone cloud green blue red small large fast slow open close start stop "
    "think check solve value result true false left right up down more less half double"
).split()


def tiny_corpus(num_lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text for training the tokenizer."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ""]))
    return lines


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE tokenizer locally and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(out_dir))
    return fast


def _moe_config(family: str, common: dict, shape: dict):
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    experts, top_k, width = shape["num_experts"], shape["top_k"], shape["moe_intermediate_size"]
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
            norm_topk_prob=shape.get("norm_topk_prob", True), decoder_sparse_step=1,
            mlp_only_layers=shape.get("mlp_only_layers", []),
        )
    if family == "qwen2_moe":
        # The last layer dense (mlp_only_layers): both MLP kinds in one model.
        return Qwen2MoeConfig(
            **common, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
            shared_expert_intermediate_size=shape["shared_expert_intermediate_size"],
            norm_topk_prob=shape.get("norm_topk_prob", False), decoder_sparse_step=1,
            mlp_only_layers=shape.get("mlp_only_layers", [shape["num_hidden_layers"] - 1]),
            use_sliding_window=False, sliding_window=None,
        )
    if family == "mixtral":
        common = {**common, "intermediate_size": width}
        return MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None)
    if family == "glm4_moe":
        # DeepSeek-V3-style routing: 4 groups of 2, 2 groups kept; the first layer dense.
        return Glm4MoeConfig(
            **common, n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
            n_shared_experts=1, n_group=shape.get("n_group", 4), topk_group=shape.get("topk_group", 2),
            routed_scaling_factor=shape.get("routed_scaling_factor", 1.5), norm_topk_prob=True,
            first_k_dense_replace=shape.get("first_k_dense_replace", 1), attention_bias=True,
            use_qk_norm=False, partial_rotary_factor=0.5,
        )
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _config(family: str, shape: dict, tokenizer):
    from transformers import CwmConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_position_embeddings"],
        rms_norm_eps=shape["rms_norm_eps"],
        hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # vLLM's GLM-4.5 never ties its head (as the real checkpoints): untied there.
        tie_word_embeddings=shape.get("tie_word_embeddings", family not in ("llama", "mistral", "cwm", "glm4_moe")),
        torch_dtype="float32",
    )
    rope = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
    if family in MOE_FAMILIES:
        cfg = _moe_config(family, common, shape)
        if family == "glm4_moe":
            rope["partial_rotary_factor"] = 0.5
        cfg.rope_parameters = rope
        return cfg
    if family == "llama":
        cfg = LlamaConfig(
            **common, attention_bias=shape.get("attention_bias", False), mlp_bias=False
        )
    elif family == "mistral":
        # Full causal attention unless a window is given (then every layer is windowed).
        cfg = MistralConfig(**common, sliding_window=shape.get("sliding_window"))
    elif family == "cwm":
        # Local and global layers alternating (sliding first) unless ``layer_types`` is given.
        layer_types = shape.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape["num_hidden_layers"])
        ]
        cfg = CwmConfig(
            **common, sliding_window=shape.get("sliding_window", 12), layer_types=layer_types, rope_parameters=dict(rope)
        )
    elif family == "qwen2":
        cfg = Qwen2Config(**common)  # Qwen2 always has q/k/v bias and no o_proj bias
    elif family == "qwen3":
        cfg = Qwen3Config(**common, attention_bias=shape.get("attention_bias", False))
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    cfg.rope_parameters = rope
    return cfg


def build_tiny_model(
    out_dir: str | os.PathLike,
    family: str = "llama",
    seed: int = 0,
    init_std: float = 0.05,
    **shape,
) -> Path:
    """Build a random tiny causal LM of ``family`` with a local tokenizer; return its directory.

    ``shape`` overrides entries of :data:`DEFAULT_SHAPE` (plus ``tie_word_embeddings``,
    ``attention_bias``, for Mistral ``sliding_window``, for CWM ``sliding_window`` and ``layer_types``). The result is saved as float32 safetensors.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    full_shape = {**DEFAULT_SHAPE, **(MOE_SHAPE if family in MOE_FAMILIES else {}), **shape}
    tokenizer = build_tokenizer(out, vocab_size=full_shape["vocab_size"], seed=seed)
    cfg = _config(family, full_shape, tokenizer)
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Non-trivial norm weights so the norm's multiply is exercised.
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A selection bias that changes some expert choices, not all of them.
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "zmrl_tiny.json").write_text(json.dumps({"family": family, "seed": seed, **full_shape}))
    return out


def build_tiny_mla_model(out_dir: str | os.PathLike, seed: int = 0, num_hidden_layers: int = 2,
                         architecture: str = "deepseek_v2", q_lora_rank: int | None = None,
                         rope_parameters: dict | None = None, first_k_dense_replace: int | None = None,
                         moe_routing: dict | None = None) -> Path:
    """A tiny DeepSeek-V2 (or ``architecture="deepseek_v3"``) checkpoint with multi-head latent
    attention (MLA) and dense MLPs.

    vLLM's CPU MLA decode kernel runs only kv_lora_rank 512 + qk_rope_head_dim 64 (block size
    16), so those two are the real model's; everything else is small. ``q_lora_rank`` gives the
    query its own low-rank projection (q_a_proj, q_a_layernorm, q_b_proj); ``rope_parameters``
    replaces the plain rotary (e.g. DeepSeek's yarn scaling). ``first_k_dense_replace`` below the
    layer count makes the later layers Mixture-of-Experts (4 experts, top-2, one shared expert; for
    DeepSeek-V3 its sigmoid routing in 2 groups, 1 kept, with a selection bias); ``moe_routing``
    replaces the routing fields (e.g. DeepSeek-V2's ``topk_method="group_limited_greedy"``).
    """
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    configs = {"deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config}
    if architecture not in configs:
        raise ValueError(f"unknown MLA architecture {architecture!r}; expected one of {sorted(configs)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=DEFAULT_SHAPE["vocab_size"], seed=seed)
    # DeepSeek-V3's routing as its config.json states it (transformers' config leaves the two names unset).
    if moe_routing is None:
        moe_routing = (dict(n_group=2, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid")
                       if architecture == "deepseek_v3" else {})
    cfg = configs[architecture](
        vocab_size=DEFAULT_SHAPE["vocab_size"], hidden_size=256, intermediate_size=512, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=q_lora_rank, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32,
        # By default every layer dense (first_k_dense_replace = all layers); the MoE fields must still be set.
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128,
        first_k_dense_replace=num_hidden_layers if first_k_dense_replace is None else first_k_dense_replace,
        **moe_routing, max_position_embeddings=DEFAULT_SHAPE["max_position_embeddings"],
        rms_norm_eps=DEFAULT_SHAPE["rms_norm_eps"], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    cfg.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": DEFAULT_SHAPE["rope_theta"]}
    cfg.initializer_range = 0.05
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))  # changes some expert choices, not all
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "zmrl_tiny.json").write_text(json.dumps({"family": f"{architecture}_mla", "seed": seed}))
    return out


def build_tiny_qwen3_next_model(out_dir: str | os.PathLike, seed: int = 0,
                                layer_types: tuple[str, ...] = ("linear_attention", "linear_attention",
                                                                  "full_attention", "linear_attention")) -> Path:
    """A tiny Qwen3-Next checkpoint: gated delta-net layers (``"linear_attention"``) and gated full
    attention (``"full_attention"``) in ``layer_types`` order, every MLP a Mixture-of-Experts (8
    experts, top-2, a gated shared expert).

    vLLM's CPU gated delta-net kernels run head dim 128 only, so the linear-attention heads are the
    real model's size (2 key heads, 4 value heads); everything else is small. Norm weights are near
    zero (Qwen3-Next scales by 1 + weight) and the decay parameters spread as the model's.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=DEFAULT_SHAPE["vocab_size"], seed=seed)
    cfg = Qwen3NextConfig(
        vocab_size=DEFAULT_SHAPE["vocab_size"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=MOE_SHAPE["num_experts"], num_experts_per_tok=MOE_SHAPE["top_k"],
        moe_intermediate_size=MOE_SHAPE["moe_intermediate_size"],
        shared_expert_intermediate_size=MOE_SHAPE["shared_expert_intermediate_size"], decoder_sparse_step=1,
        max_position_embeddings=DEFAULT_SHAPE["max_position_embeddings"], rms_norm_eps=DEFAULT_SHAPE["rms_norm_eps"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    cfg.initializer_range = 0.05
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and ".linear_attn." not in name:
                p.copy_(0.1 * torch.randn_like(p))  # scale 1 + weight
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # the gated norm scales by its weight
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "zmrl_tiny.json").write_text(json.dumps({"family": "qwen3_next", "seed": seed, "layer_types": list(layer_types)}))
    return out


def build_tiny_kimi_linear_model(out_dir: str | os.PathLike, seed: int = 0, num_hidden_layers: int = 2,
                                 num_heads: int = 4, head_dim: int = 64, conv_kernel: int = 4,
                                 gate_lower_bound: float | None = None, first_moe_layer: int | None = None) -> Path:
    """A tiny Kimi Linear checkpoint: every layer Kimi Delta Attention (KDA, the low-rank gate),
    written under vLLM's ``KimiLinearForCausalLM`` names (transformers has no Kimi Linear model, so
    the tensors are drawn here). MLPs are dense SwiGLU, or from layer ``first_moe_layer`` on Kimi's
    Mixture-of-Experts (8 experts, top-2, sigmoid scores in 2 groups with 1 kept, a selection
    bias, routed scale 2.5, one shared expert). ``gate_lower_bound`` gives the decay its "safe
    gate" form. The decay parameters spread as a trained model's: A_log = log U(1, 16)."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=DEFAULT_SHAPE["vocab_size"], seed=seed)
    vocab, hidden, inter = DEFAULT_SHAPE["vocab_size"], 256, 512
    size = num_heads * head_dim
    kda = dict(kda_layers=list(range(1, num_hidden_layers + 1)), full_attn_layers=[], head_dim=head_dim,
               num_heads=num_heads, short_conv_kernel_size=conv_kernel)
    if gate_lower_bound is not None:
        kda["gate_lower_bound"] = gate_lower_bound
    config = dict(
        architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=num_hidden_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, head_dim=head_dim, hidden_act="silu", rms_norm_eps=DEFAULT_SHAPE["rms_norm_eps"],
        max_position_embeddings=DEFAULT_SHAPE["max_position_embeddings"], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        torch_dtype="float32", linear_attn_config=kda,
    )
    moe = dict(num_experts=MOE_SHAPE["num_experts"], num_experts_per_token=MOE_SHAPE["top_k"],
               moe_intermediate_size=MOE_SHAPE["moe_intermediate_size"], num_shared_experts=1,
               first_k_dense_replace=first_moe_layer, moe_router_activation_func="sigmoid", use_grouped_topk=True,
               num_expert_group=2, topk_group=1, routed_scaling_factor=2.5, moe_renormalize=True)
    if first_moe_layer is not None:
        config.update(moe)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, std=0.05, mean=0.0):
        return (mean + std * torch.randn(*shape, generator=generator)).contiguous()

    tensors = {"model.embed_tokens.weight": draw(vocab, hidden, std=1.0), "model.norm.weight": draw(hidden, std=0.1, mean=1.0),
               "lm_head.weight": draw(vocab, hidden)}
    for i in range(num_hidden_layers):
        layer, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        tensors.update({
            layer + "input_layernorm.weight": draw(hidden, std=0.1, mean=1.0),
            layer + "post_attention_layernorm.weight": draw(hidden, std=0.1, mean=1.0),
            **{attn + f"{n}_proj.weight": draw(size, hidden) for n in "qkv"},
            **{attn + f"{n}_conv1d.weight": draw(size, 1, conv_kernel, std=0.3) for n in "qkv"},
            attn + "b_proj.weight": draw(num_heads, hidden),
            attn + "f_a_proj.weight": draw(head_dim, hidden), attn + "f_b_proj.weight": draw(size, head_dim),
            attn + "g_a_proj.weight": draw(head_dim, hidden), attn + "g_b_proj.weight": draw(size, head_dim),
            attn + "A_log": torch.log(torch.empty(num_heads).uniform_(1, 16, generator=generator)),
            attn + "dt_bias": draw(size, std=0.5),
            attn + "o_norm.weight": draw(head_dim, std=0.1, mean=1.0),
            attn + "o_proj.weight": draw(hidden, size),
        })
        if first_moe_layer is not None and i >= first_moe_layer:
            block, width = layer + "block_sparse_moe.", moe["moe_intermediate_size"]
            tensors[block + "gate.weight"] = draw(moe["num_experts"], hidden, std=0.1)
            tensors[block + "gate.e_score_correction_bias"] = draw(moe["num_experts"], std=0.05)  # changes some choices
            for e in range(moe["num_experts"]):
                tensors.update({block + f"experts.{e}.w1.weight": draw(width, hidden),
                                block + f"experts.{e}.w3.weight": draw(width, hidden),
                                block + f"experts.{e}.w2.weight": draw(hidden, width)})
            tensors.update({block + f"shared_experts.{n}.weight": draw(*shape) for n, shape in
                            (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)), ("down_proj", (hidden, width)))})
        else:
            tensors.update({layer + "mlp.gate_proj.weight": draw(inter, hidden), layer + "mlp.up_proj.weight": draw(inter, hidden),
                            layer + "mlp.down_proj.weight": draw(hidden, inter)})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "zmrl_tiny.json").write_text(json.dumps({"family": "kimi_linear", "seed": seed, "linear_attn_config": kda,
                                                    "first_moe_layer": first_moe_layer}))
    return out
