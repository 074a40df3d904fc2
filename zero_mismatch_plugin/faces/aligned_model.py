"""The aligned trainer model: the decoders of :mod:`..architectures`, built from the aligned ops.

Parameters carry the Hugging Face checkpoint names and live in fp32 on the trainer; the forward
runs vLLM's kernels in vLLM's order (:func:`decoder_layer`), so its sampled-token logprobs are the
engine's bits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import functools
import json
import os

import torch
from torch import nn

from zero_mismatch_plugin.aligned import numerics
from zero_mismatch_plugin.aligned.checkpoint import copy_checkpoint, read_checkpoint
from zero_mismatch_plugin.aligned.cpu_gemm import require_invariant_gemms, require_invariant_packed_gemms
from zero_mismatch_plugin.aligned.ops import (
    AlignedAttention,
    AlignedLinear,
    AlignedLogits,
    AlignedRMSNorm,
    AlignedRotary,
    AlignedSiluAndMul,
)
from zero_mismatch_plugin.aligned.mla import AlignedMLAAttention, plan_mla
from zero_mismatch_plugin.aligned.moe import AlignedMoE, moe_mlp
from zero_mismatch_plugin.aligned.packing import PackedBatch
from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid
from zero_mismatch_plugin.aligned.runtime import VllmRuntime
from zero_mismatch_plugin.aligned.sampling import SamplingTransform, recorded_logprobs
from zero_mismatch_plugin.faces.checkpoint_layout import Weights, mla_projections, moe_block, swiglu
from zero_mismatch_plugin.faces.hybrid_layers import (
    linear_attention_mixer,
    linear_attention_ops,
    linear_attention_weights,
)
from zero_mismatch_plugin.tables.architectures import MOE_CHECKPOINT_NAMES, Blocks, describe


_MOE_NAMES = MOE_CHECKPOINT_NAMES


class _Layer(nn.Module):
    def __init__(self, config, blocks: Blocks, index: int = 0):
        super().__init__()
        h, head_dim = config.hidden_size, blocks.head_dim
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        inter = config.intermediate_size
        qb = nh * head_dim if blocks.qkv_bias else None
        kvb = nkv * head_dim if blocks.qkv_bias else None
        # q_proj's rows hold each head's query and, with a gated output, its gate after it.
        q_rows = nh * head_dim * (2 if blocks.attention_output_gate else 1)
        if blocks.mixer_kind(index) == "linear":
            attn = None
            setattr(self, *linear_attention_weights(h, blocks.linear_attention))
        elif blocks.attention == "mla":
            attn = mla_projections(h, nh, blocks.mla)
        else:
            attn = nn.Module()
            attn.q_proj = Weights((q_rows, h), qb)
            attn.k_proj = Weights((nkv * head_dim, h), kvb)
            attn.v_proj = Weights((nkv * head_dim, h), kvb)
            attn.o_proj = Weights((h, nh * head_dim), h if blocks.o_bias else None)
        if attn is not None:
            if blocks.qk_norm:
                attn.q_norm = Weights((head_dim,))
                attn.k_norm = Weights((head_dim,))
            self.self_attn = attn
        if blocks.mlp_kind(index) == "moe":
            name, block = moe_block(h, blocks.moe)
            setattr(self, name, block)
        else:
            self.mlp = swiglu(h, inter)
        self.input_layernorm = Weights((h,))
        self.post_attention_layernorm = Weights((h,))


@dataclass(frozen=True)
class AttentionHeads:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    output_gate: bool = False  # q_proj holds each head's query then its output gate (Qwen3-Next)

    def split(self, qkv: torch.Tensor, norms: dict):
        """q, k, v of the fused projection (q and k through the per-head norms when the layer has
        them) and the output gate [T, heads * D] (None without one), as vLLM's model splits them."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        gate = None
        if self.output_gate:
            q_gate, k, v = qkv.split([2 * q_size, kv_size, kv_size], dim=-1)
            q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(-1, q_size), gate.reshape(-1, q_size)
        else:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if "q_norm" in norms:
            t = q.shape[0]
            q = norms["q_norm"](q.reshape(t, self.num_heads, self.head_dim)).reshape(t, q_size)
            k = norms["k_norm"](k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, kv_size)
        return q, k, v, gate


def residual_layer(norms, hidden, residual, attention, mlp):
    """The residual frame of every decoder layer in vLLM's op order: [fused add] input norm, the
    attention block ``attention(x)`` (projections through o_proj), fused add post norm, ``mlp(x)``.
    Returns (hidden, residual) for the next layer's fused add norm."""
    if residual is None:
        residual = hidden
        hidden = norms["input_norm"](hidden)
    else:
        hidden, residual = norms["input_norm"](hidden, residual)
    hidden, residual = norms["post_norm"](attention(hidden), residual)
    return mlp(hidden), residual


def decoder_layer(norms, hidden, residual, positions, heads: AttentionHeads, rotary, *, linear, attend, mlp):
    """One decoder layer in vLLM's op order, for both trainer forwards that run it (this model and
    verl's FSDP actor): [fused add] norm, qkv, [q/k norm], rotary, attention, o, fused add norm, MLP.

    ``norms``: the layer's norm ops (``input_norm``, ``post_norm``, ``q_norm``/``k_norm`` where the
    architecture has them); ``linear(name, x)``: its ``qkv`` and ``o`` projections; ``attend(q, k, v)``;
    ``mlp(x)``. Returns (hidden, residual) for the next layer's fused add norm."""

    def attention(hidden):
        q, k, v, gate = heads.split(linear("qkv", hidden), norms)
        q, k = rotary(positions, q, k)
        out = attend(q, k, v.contiguous())
        if gate is not None:  # the engine's sigmoid is row-invariant in consistent mode on CPU
            out = out * row_invariant_sigmoid(gate)
        return linear("o", out)

    return residual_layer(norms, hidden, residual, attention, mlp)


def rotary_parameters(config, blocks: Blocks) -> dict | None:
    """The rope parameters vLLM builds the rotary from: the config's, with the architecture's
    partial rotary factor where it turns only part of each head."""
    rope_parameters = getattr(config, "rope_parameters", None)
    if blocks.partial_rotary_factor != 1.0:
        rope_parameters = {**(rope_parameters or {}), "partial_rotary_factor": blocks.partial_rotary_factor}
    return rope_parameters


def moe_block_ops(runtime: VllmRuntime, moe, block, router, experts: AlignedMoE) -> dict:
    """The ops of one MoE block (both trainer forwards that run it: this model and verl's FSDP
    actor): the ``router`` gate linear, the routed ``experts`` op, and the shared expert of
    ``block`` (and its gate) where the architecture has one, under the checkpoint's names."""
    ops = dict(router=AlignedLinear(runtime, [router.weight]), experts=experts)
    if moe.shared_expert_intermediate_size:
        shared = getattr(block, _MOE_NAMES[moe.names][3])
        ops["shared_gate_up"] = AlignedLinear(runtime, [shared.gate_proj.weight, shared.up_proj.weight])
        ops["shared_down"] = AlignedLinear(runtime, [shared.down_proj.weight])
        if moe.shared_expert_gate:
            ops["shared_expert_gate"] = AlignedLinear(runtime, [block.shared_expert_gate.weight])
    return ops


def layer_mlp(ops: dict, act, linear, hidden: torch.Tensor) -> torch.Tensor:
    """A layer's MLP in vLLM's order: dense SwiGLU (``linear("gate_up" | "down", x)``), or shared
    expert + routed experts (the ops of :func:`moe_block_ops`)."""
    if "experts" not in ops:
        return linear("down", act(linear("gate_up", hidden)))
    shared = None
    if "shared_down" in ops:
        shared = (ops["shared_gate_up"], act, ops["shared_down"], ops.get("shared_expert_gate"))
    return moe_mlp(hidden, ops["router"], ops["experts"], shared)


class AlignedCausalLM(nn.Module):
    """A trainable decoder whose per-token logprobs equal vLLM's, bit for bit."""

    def __init__(self, runtime: VllmRuntime):
        super().__init__()
        config = runtime.hf_config
        self.blocks = describe(config)
        self.runtime = runtime
        self.config = config
        self.architecture = self.blocks.architecture
        self.head_dim = self.blocks.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.vocab_size = config.vocab_size
        self.tied = self.blocks.tied_head

        self.model = nn.Module()
        self.model.embed_tokens = Weights((config.vocab_size, config.hidden_size))
        self.model.layers = nn.ModuleList(
            _Layer(config, self.blocks, i) for i in range(config.num_hidden_layers)
        )
        self.model.norm = Weights((config.hidden_size,))
        if not self.tied:
            self.lm_head = Weights((config.vocab_size, config.hidden_size))
        self._ops_built = False

    # ----- construction ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike,
        dtype: str = "float32",
        lora_dir: str | os.PathLike | None = None,
        **engine_kwargs,
    ):
        """Load the checkpoint vLLM loads; ``engine_kwargs`` must match the engine's.

        With ``lora_dir`` (a PEFT adapter) the base is frozen and the adapter is the trainable
        part (see :meth:`load_adapter`); the engine's ``enable_lora`` / ``max_lora_rank`` belong
        in ``engine_kwargs``.
        """
        if lora_dir is not None and not engine_kwargs.get("enable_lora"):
            raise ValueError(
                "lora_dir needs the engine's LoRA arguments: pass enable_lora=True and the engine's "
                "max_lora_rank (the trainer pads the adapter to it, as the engine does)"
            )
        runtime = VllmRuntime(model_dir, dtype=dtype, **engine_kwargs)
        model = cls(runtime)
        model.load_checkpoint(model_dir)
        if lora_dir is not None:
            model.load_adapter(lora_dir)
        return model

    def load_checkpoint(self, model_dir: str | os.PathLike) -> None:
        state = read_checkpoint(model_dir)
        if self.tied:
            state.pop("lm_head.weight", None)
        base = {n: p for n, p in self.named_parameters() if not n.startswith("lora.")}
        copy_checkpoint(base, state, ignored=("rotary_emb",))
        self.to(self.runtime.device)
        self._build_ops()

    def _build_ops(self) -> None:
        rt = self.runtime
        cfg = self.config
        eps = cfg.rms_norm_eps
        max_pos = getattr(cfg, "max_position_embeddings", 8192)
        rope_parameters = rotary_parameters(cfg, self.blocks)
        self.act = AlignedSiluAndMul(rt)
        if self.blocks.attention == "mla":
            self._build_mla_ops(max_pos, rope_parameters)
            return
        self.rotary = AlignedRotary(rt, self.head_dim, max_pos, rope_parameters)
        # One backend per distinct window (vLLM's attention layer carries its window); ``attention``
        # is the first layer's, the others are looked up by window (see _layer_attention).
        windows = [self.blocks.window_of(i) for i in range(len(self.model.layers))]
        self.attention_by_window = {
            window: AlignedAttention(
                rt, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window
            )
            for window in dict.fromkeys(windows)
        }
        self.attention = self.attention_by_window[windows[0]]
        self.layer_ops = []
        gemma = self.blocks.norm == "gemma_rms"
        for index, layer in enumerate(self.model.layers):
            ops = dict(
                input_norm=AlignedRMSNorm(rt, layer.input_layernorm.weight, eps, gemma),
                post_norm=AlignedRMSNorm(rt, layer.post_attention_layernorm.weight, eps, gemma),
            )
            if self.blocks.mixer_kind(index) == "linear":
                linear = self.blocks.linear_attention
                ops.update(linear_attention_ops(rt, getattr(layer, linear.module), linear, eps))
            else:
                a = layer.self_attn
                qkv_bias = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias] if self.blocks.qkv_bias else None
                ops.update(qkv=AlignedLinear(rt, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], qkv_bias),
                           o=AlignedLinear(rt, [a.o_proj.weight], [a.o_proj.bias] if self.blocks.o_bias else None))
                if self.blocks.qk_norm:
                    ops["q_norm"] = AlignedRMSNorm(rt, a.q_norm.weight, eps, gemma)
                    ops["k_norm"] = AlignedRMSNorm(rt, a.k_norm.weight, eps, gemma)
            if self.blocks.mlp_kind(index) == "moe":
                ops.update(self._moe_ops(layer))
            else:
                ops.update(
                    gate_up=AlignedLinear(rt, [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
                    down=AlignedLinear(rt, [layer.mlp.down_proj.weight]),
                )
            self.layer_ops.append(ops)
        self._build_head_ops()

    def _build_head_ops(self) -> None:
        rt = self.runtime
        self.final_norm = AlignedRMSNorm(rt, self.model.norm.weight, self.config.rms_norm_eps,
                                         gemma=self.blocks.norm == "gemma_rms")
        head_weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        self.logits_head = AlignedLogits(rt, head_weight, self.vocab_size)
        self._build_lora_ops()
        self._ops_built = True
        if rt.platform == "cpu" and numerics.is_consistent():
            self.check_cpu_gemm_invariance()

    def _build_mla_ops(self, max_pos: int, rope_parameters) -> None:
        """Multi-head latent attention layers (DeepSeek-V2/V3), as vLLM's ``DeepseekV2MLAAttention``
        builds them: an interleaved (GPT-J style) rotary on the rope dims only, with the model's
        renamed rope type, and yarn's mscale^2 in the softmax scale."""
        from vllm.model_executor.models.deepseek_v2 import yarn_get_mscale

        rt, cfg, mla = self.runtime, self.config, self.blocks.mla
        eps = cfg.rms_norm_eps
        rope_parameters = {**(rope_parameters or {}), "rope_type": mla.rope_type}
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        self.rotary = AlignedRotary(rt, mla.qk_rope_head_dim, max_pos, rope_parameters, is_neox_style=False)
        self.rotary_per_head = not isinstance(self.rotary.module, RotaryEmbedding)
        scale = mla.qk_head_dim**-0.5
        if mla.rope_type == "deepseek_yarn":
            mscale = yarn_get_mscale(rope_parameters["factor"], float(rope_parameters.get("mscale_all_dim", False)))
            scale = scale * mscale * mscale
        self.layer_ops = []
        for index, layer in enumerate(self.model.layers):
            a = layer.self_attn
            attention = AlignedMLAAttention(rt, mla, self.num_heads, scale, a.kv_b_proj.weight)
            ops = dict(
                input_norm=AlignedRMSNorm(rt, layer.input_layernorm.weight, eps),
                post_norm=AlignedRMSNorm(rt, layer.post_attention_layernorm.weight, eps),
                kv_a_norm=AlignedRMSNorm(rt, a.kv_a_layernorm.weight, eps),
                mla=attention,
                kv_b=attention.kv_b,
                o=AlignedLinear(rt, [a.o_proj.weight]),
            )
            if self.blocks.mlp_kind(index) == "moe":
                ops.update(self._moe_ops(layer))
            else:
                ops.update(gate_up=AlignedLinear(rt, [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
                           down=AlignedLinear(rt, [layer.mlp.down_proj.weight]))
            if mla.q_lora_rank is None:
                ops.update(kv_a=AlignedLinear(rt, [a.kv_a_proj_with_mqa.weight]), q=AlignedLinear(rt, [a.q_proj.weight]))
            else:
                # vLLM's fused_qkv_a_proj: q_a_proj and kv_a_proj_with_mqa merged, one GEMM.
                ops.update(qkv_a=AlignedLinear(rt, [a.q_a_proj.weight, a.kv_a_proj_with_mqa.weight]),
                           q_a_norm=AlignedRMSNorm(rt, a.q_a_layernorm.weight, eps),
                           q=AlignedLinear(rt, [a.q_b_proj.weight]))
            self.layer_ops.append(ops)
        self._build_head_ops()

    def _mla_attention(self, layer: int, hidden: torch.Tensor, *, positions: torch.Tensor, plan) -> torch.Tensor:
        """``MultiHeadLatentAttentionWrapper.forward``: projections, norms and rotary per row, then the
        attention of :class:`.mla.AlignedMLAAttention` and o_proj."""
        ops, mla = self.layer_ops[layer], self.blocks.mla
        latent_size = mla.kv_lora_rank + mla.qk_rope_head_dim
        linear = functools.partial(self._linear, layer)  # the adapter's op where it targets the linear
        if mla.q_lora_rank is None:
            kv_lora = linear("kv_a", hidden)
            q_input = hidden
        else:
            q_c, kv_lora = linear("qkv_a", hidden).split([mla.q_lora_rank, latent_size], dim=-1)
            q_input = ops["q_a_norm"](q_c)
        kv_c, k_pe = kv_lora.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv_c_normed = ops["kv_a_norm"](kv_c)
        t = hidden.shape[0]
        q = linear("q", q_input).view(t, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        if self.rotary_per_head:
            # DeepSeek's scaled rotaries (forward_native) broadcast over the head axis MLA passes.
            q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.unsqueeze(1))
        else:
            # The plugin's patched engine hands vLLM's rotary kernel these rows: [T, heads * rope], [T, rope].
            q_pe, k_pe = self.rotary(positions, q_pe.reshape(t, -1), k_pe)
        q = torch.cat([q_nope, q_pe.reshape(t, self.num_heads, mla.qk_rope_head_dim)], dim=-1)
        k_pe = k_pe.reshape(t, mla.qk_rope_head_dim)
        return linear("o", ops["mla"](q, kv_c_normed, k_pe, plan))

    # ----- LoRA ------------------------------------------------------------------------------

    def load_adapter(self, lora_dir: str | os.PathLike) -> None:
        """Attach the PEFT adapter in ``lora_dir`` (trainable, ``self.lora``) and freeze the base:
        targeted linears then run vLLM's LoRA arithmetic (:mod:`.lora`), never a merged weight."""
        from zero_mismatch_plugin.aligned.lora.adapter import LoRAAdapter

        adapter = LoRAAdapter.from_dir(lora_dir, self.config, self.head_dim, vocab=True)
        for p in self.parameters():
            p.requires_grad_(False)
        self.lora = adapter.to(self.runtime.device)
        self._build_lora_ops()

    def _build_lora_ops(self) -> None:
        self.lora_enabled = getattr(self, "lora", None) is not None
        self.lora_ops = [{} for _ in self.layer_ops]
        if self.lora_enabled:
            from zero_mismatch_plugin.aligned.lora.names import (
                HYBRID_MERGED_TARGETS,
                KDA_MERGED_TARGETS,
                MERGED_TARGETS,
                MLA_MERGED_TARGETS,
                MLA_Q_LORA_MERGED_TARGETS,
            )
            from zero_mismatch_plugin.aligned.lora.ops import lora_linears

            linear = self.blocks.linear_attention
            merged = MERGED_TARGETS if linear is None else KDA_MERGED_TARGETS if linear.kind == "kda" else HYBRID_MERGED_TARGETS
            if self.blocks.attention == "mla":
                merged = MLA_MERGED_TARGETS if self.blocks.mla.q_lora_rank is None else MLA_Q_LORA_MERGED_TARGETS
            self.lora_ops = lora_linears(self.runtime, self.lora, self.layer_ops, merged)
        self._build_lora_vocab_ops()

    def _build_lora_vocab_ops(self) -> None:
        # embed_tokens / lm_head adapters: vLLM's LoRA embedding and logits layers on the trainer's A, B.
        self.lora_vocab_ops = {}
        if self.lora_enabled:
            from zero_mismatch_plugin.aligned.lora.vocab_ops import lora_vocab_ops

            self.lora_vocab_ops = lora_vocab_ops(self.runtime, self.lora, self.model.embed_tokens.weight, self.logits_head)

    def _vocab_op(self, target: str, base):
        op = self.lora_vocab_ops.get(target) if self.lora_enabled else None
        return op or base

    @contextlib.contextmanager
    def adapter_disabled(self):
        """Run the base model (a request without adapter) inside the block."""
        previous, self.lora_enabled = self.lora_enabled, False
        try:
            yield self
        finally:
            self.lora_enabled = previous

    def save_adapter(self, adapter_dir: str | os.PathLike):
        """Write the current adapter in PEFT's format, for a ``LoRARequest`` to load."""
        return self.lora.save(adapter_dir)

    def _linear(self, layer: int, key: str, x: torch.Tensor) -> torch.Tensor:
        return self._lora_or_base(layer, key)(x)

    @property
    def layer_attention(self) -> list[AlignedAttention]:
        return [self._layer_attention(i) for i in range(len(self.layer_ops))]

    def _layer_attention(self, index: int):
        # Through ``self.attention`` wherever the first layer's window applies, so that a wrapper
        # set on that attribute (the checker's op recorder) sees those layers' calls.
        window = self.blocks.window_of(index)
        return self.attention if window == self.blocks.window_of(0) else self.attention_by_window[window]

    def _moe_ops(self, layer) -> dict:
        """The router gate, vLLM's MoE layer and any shared expert of one MoE layer."""
        moe = self.blocks.moe
        block_name, gate_name, (g, u, d), _ = _MOE_NAMES[moe.names]
        block = getattr(layer, block_name)
        gate = getattr(block, gate_name)
        experts = AlignedMoE(
            self.runtime,
            moe,
            self.config.hidden_size,
            [getattr(e, g).weight for e in block.experts],
            [getattr(e, u).weight for e in block.experts],
            [getattr(e, d).weight for e in block.experts],
            getattr(gate, "e_score_correction_bias", None),
        )
        return moe_block_ops(self.runtime, moe, block, gate, experts)

    def _mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        # With the adapter on, its ops (routed experts, shared expert, linears) replace the base ones.
        ops = {**self.layer_ops[layer], **self.lora_ops[layer]} if self.lora_enabled else self.layer_ops[layer]
        return layer_mlp(ops, self.act, functools.partial(self._linear, layer), hidden)

    def _lora_or_base(self, layer: int, key: str):
        """The layer's op ``key`` with the adapter where it has one and it is enabled, else the base op."""
        op = self.lora_ops[layer].get(key) if self.lora_enabled else None
        return op or self.layer_ops[layer][key]

    def all_linears(self) -> dict[str, AlignedLinear]:
        out = {}
        for i, ops in enumerate(self.layer_ops):
            for key, op in ops.items():
                if isinstance(op, AlignedLinear):
                    out[f"layers.{i}.{key}"] = op
        return out

    def check_cpu_gemm_invariance(self) -> dict:
        """Probe every distinct CPU GEMM shape, the LoRA-capable experts' packed GEMMs included;
        refuse one whose rows depend on M (:func:`~zero_mismatch_plugin.aligned.cpu_gemm.require_invariant_gemms`,
        :func:`~zero_mismatch_plugin.aligned.cpu_gemm.require_invariant_packed_gemms`)."""
        probes = require_invariant_gemms(self.all_linears(), self.logits_head, self.config.hidden_size,
                                         self.runtime.dtype)
        packed = {}
        for ops in (*self.layer_ops, *self.lora_ops):
            for op in ops.values():
                packed.update(getattr(op, "packed_gemm_weights", dict)())
        return {**probes, **require_invariant_packed_gemms(packed)}

    def refresh_derived_weights(self) -> None:
        """Re-derive every engine-layout copy now (needed after writes through ``param.data``)."""
        for ops in self.layer_ops:
            for op in ops.values():
                derived = getattr(op, "derived", None) or getattr(op, "engine_weight", None)
                if derived is not None:  # the linear-attention mixer casts its weights per call
                    derived.refresh()
            if "mla" in ops:
                ops["mla"].absorbed.refresh()
        for ops in self.lora_ops:
            for op in ops.values():
                op.derived.refresh()
        for op in self.lora_vocab_ops.values():
            op.derived.refresh()
        self.final_norm.engine_weight.refresh()
        self.logits_head.derived.refresh()

    # ----- forward --------------------------------------------------------------------------

    def hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states [T, hidden] of the packed batch (vLLM's layer order)."""
        ids = batch.input_ids.to(self.runtime.device)
        positions = batch.positions.to(self.runtime.device)
        plans = {}  # one backend plan per attention (window) per forward
        embed = self.model.embed_tokens.weight
        lora_embed = self._vocab_op("embed_tokens", None)
        if lora_embed is not None:
            hidden = lora_embed(ids)
        else:
            hidden = nn.functional.embedding(ids, embed.to(self.runtime.dtype) if embed.dtype != self.runtime.dtype else embed)
        residual = None
        heads = AttentionHeads(self.num_heads, self.num_kv_heads, self.head_dim, self.blocks.attention_output_gate)
        mla_plan = None
        if self.blocks.attention == "mla":
            prompt_lens = [n - r for n, r in zip(batch.seq_lens, batch.response_lens)]
            mla_plan = plan_mla(batch.seq_lens, prompt_lens, self.runtime.device)
        for i, ops in enumerate(self.layer_ops):
            if mla_plan is not None:
                attend_mla = functools.partial(self._mla_attention, i, positions=positions, plan=mla_plan)
                hidden, residual = residual_layer(ops, hidden, residual, attend_mla, functools.partial(self._mlp, i))
                continue
            if self.blocks.mixer_kind(i) == "linear":
                mixer = functools.partial(linear_attention_mixer, ops, functools.partial(self._linear, i),
                                          seq_lens=batch.seq_lens)
                hidden, residual = residual_layer(ops, hidden, residual, mixer, functools.partial(self._mlp, i))
                continue
            attention = self._layer_attention(i)
            if attention not in plans:
                plans[attention] = attention.plan(batch.seq_lens)
            hidden, residual = decoder_layer(
                ops, hidden, residual, positions, heads, self.rotary,
                linear=functools.partial(self._linear, i),
                attend=lambda q, k, v, a=attention: a(q, k, v, plans[a], batch.seq_lens),
                mlp=functools.partial(self._mlp, i),
            )
        if self.blocks.final_add_then_norm:
            return self.final_norm(hidden + residual)
        hidden, _ = self.final_norm(hidden, residual)
        return hidden

    def logits(self, batch: PackedBatch) -> torch.Tensor:
        """Logits [R, vocab] at the rows that predict the response tokens."""
        hidden = self.hidden_states(batch)
        rows = batch.target_rows.to(hidden.device)
        return self._vocab_op("lm_head", self.logits_head)(hidden.index_select(0, rows))

    def token_logprobs(
        self, batch: PackedBatch, transform: SamplingTransform | None = None, strict: bool = True
    ) -> torch.Tensor:
        """Logprob [R] of every response token under the engine's recorded distribution."""
        return recorded_logprobs(self.logits(batch), batch.target_ids, transform, strict)

    def describe(self) -> str:
        return json.dumps(
            dict(
                blocks=self.blocks.as_dict(),
                dtype=str(self.runtime.dtype),
                head_dtype=str(self.runtime.head_dtype),
                platform=self.runtime.platform,
                mode=self.runtime.mode,
            )
        )
