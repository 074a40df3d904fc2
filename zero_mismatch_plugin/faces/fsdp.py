"""The aligned forward inside verl's FSDP2 units: the op layer, in vLLM's layer order, over the
parameters of an HF decoder and of the PEFT LoRA adapter verl may put on it.

verl's FSDP engine is patched to run it by :mod:`zero_mismatch_plugin.integrations.verl.fsdp_engine`;
how it meets FSDP2's units, and what it covers: docs/fsdp.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

from zero_mismatch_plugin.tables.switches import FSDP_ALIGNED

PEFT_ADAPTER = "default"  # the adapter name verl's get_peft_model / PeftModel.from_pretrained give


class UnsupportedFSDPFeature(NotImplementedError):
    """A setting of verl's FSDP engine under which the aligned forward cannot reproduce vLLM."""


@dataclass
class PackedMicroBatch:
    """One micro-batch in vLLM's packed layout, with verl's per-token labels and temperatures."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    seq_lens: list[int]
    cu_seqlens: torch.Tensor  # [B + 1], verl's offsets of the jagged tensors
    labels: torch.Tensor  # [T] the next token (verl's rolled input_ids; the last row of a sequence is unused)
    temperature: torch.Tensor  # [T] fp32, the sampling temperature of each row's sequence


# ----- the aligned forward over an HF decoder's (FSDP) parameters ---------------------------


def _derived_weights(ops: dict):
    """The engine-layout weights of one module's ops (a LoRA op's adapter, then its base)."""
    for op in ops.values():
        for part in (op, getattr(op, "base", None)):
            derived = getattr(part, "derived", None) or getattr(part, "engine_weight", None)
            if derived is not None:
                yield derived


def _refresh_derived(ops: dict) -> None:
    """Re-derive the engine-layout weights of one module's ops (FSDP2 refills gathered parameters
    in place without bumping their versions: their DerivedWeights cannot see it)."""
    for derived in _derived_weights(ops):
        derived.refresh()


def _refreshed_by_generation(ops: dict) -> dict:
    """``ops``, their engine-layout copies derived again only after :meth:`AlignedFSDPForward.mark_stale`:
    FSDP2 gathers each unit's parameters into new storage before every forward, values unchanged,
    so following the storage would merge, pack (oneDNN) and load every weight at every forward.
    A derived view of a parameter (a norm weight already in the engine dtype) keeps following it."""
    for derived in _derived_weights(ops):
        if derived.copies:
            derived.refreshed_by_owner()
    return ops


class AlignedFSDPForward:
    """The op layer over the parameters of one HF decoder (``model.layers``, ``model.norm``,
    ``model.embed_tokens``, ``lm_head``: the checkpoint names the aligned model uses too).

    The ops are built from the parameter objects the modules hold while their FSDP unit is
    gathered, rebuilt if FSDP hands out other objects, and their engine-layout weights
    re-derived when :meth:`mark_stale` was called (after optimizer steps and checkpoint loads).
    """

    def __init__(self, runtime, hf_config, lora_config=None):
        from zero_mismatch_plugin.aligned.derived import OpCache
        from zero_mismatch_plugin.aligned.lora.ops import TokenMapping
        from zero_mismatch_plugin.faces.aligned_model import AttentionHeads, decoder_layer, layer_mlp, rotary_parameters
        from zero_mismatch_plugin.aligned.ops import AlignedAttention, AlignedRotary, AlignedSiluAndMul
        from zero_mismatch_plugin.tables.architectures import describe

        self.runtime = runtime
        self.config = hf_config
        self.blocks = describe(hf_config)
        # The aligned model covers these; this face's layer forward does not run them yet.
        aligned_model_only = self.blocks.aligned_model_only()
        missing = (["sliding-window attention"] if self.blocks.sliding_windows else []) + (
            [aligned_model_only] if aligned_model_only else [])
        if lora_config is not None and any(
                self.blocks.mlp_kind(i) == "moe" for i in range(hf_config.num_hidden_layers)):
            missing.append("LoRA adapters on Mixture-of-Experts layers")
        if missing:
            raise NotImplementedError(
                f"{self.blocks.architecture}: the aligned FSDP actor forward does not cover "
                f"{' and '.join(missing)} yet; set {FSDP_ALIGNED}=0 to train with verl's own forward.")
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = self.blocks.head_dim
        self.heads = AttentionHeads(self.num_heads, self.num_kv_heads, self.head_dim)
        self.decoder_layer = decoder_layer  # the aligned model's layer, op for op
        self.layer_mlp = layer_mlp  # ... and its MLP
        self.eps = hf_config.rms_norm_eps
        max_pos = getattr(hf_config, "max_position_embeddings", 8192)
        self.rotary = AlignedRotary(runtime, self.head_dim, max_pos, rotary_parameters(hf_config, self.blocks))
        self.act = AlignedSiluAndMul(runtime)
        self.attention = AlignedAttention(runtime, self.num_heads, self.num_kv_heads, self.head_dim,
                                          self.head_dim**-0.5)
        self.lora_config = lora_config  # the PEFT adapter's (LoRAConfig), None without one
        self.lora_mapping = TokenMapping(runtime) if lora_config is not None else None
        self._ops = OpCache(refresh=_refresh_derived)  # id(module) -> that module's ops (a dict)
        self._probed: set[tuple] = set()
        self.generation = 0  # the engine's weights generation the ops were derived at

    def mark_stale(self) -> None:
        """The sharded weights changed: re-derive every engine-layout copy at its next use."""
        self._ops.mark_stale()

    def _cached(self, module, params, build) -> dict:
        """``module``'s ops, built over ``params`` (and checked) again when FSDP hands out other
        parameter objects."""
        return self._ops.get(id(module), params, lambda: self._checked_gemms(_refreshed_by_generation(build())))

    def _checked_gemms(self, ops: dict) -> dict:
        """``ops``, after refusing, on CPU in consistent mode, a GEMM whose rows depend on the row
        count (the engine computes a row in batches of other sizes), as the aligned model does."""
        from zero_mismatch_plugin.aligned import numerics
        from zero_mismatch_plugin.aligned.cpu_gemm import probe_linear, require_invariant
        from zero_mismatch_plugin.aligned.ops import AlignedLinear, AlignedLogits

        if self.runtime.platform != "cpu" or not numerics.is_consistent():
            return ops
        for name, op in ops.items():
            op = getattr(op, "base", op)  # a LoRA op's base GEMM
            if isinstance(op, AlignedLinear):
                _, weight = op.derived.get()
                n, k = weight.shape
                apply = op.kernel
            elif isinstance(op, AlignedLogits):
                n, k = op.padded_vocab, self.config.hidden_size
                apply = op.kernel
            else:
                continue
            if (type(op).__name__, n, k) in self._probed:
                continue
            require_invariant(probe_linear(apply, n=n, k=k, dtype=self.runtime.dtype), name)
            self._probed.add((type(op).__name__, n, k))
        return ops

    def layer_ops(self, index: int, layer) -> dict:
        from zero_mismatch_plugin.aligned.ops import AlignedLinear, AlignedRMSNorm

        a, m = layer.self_attn, layer.mlp
        qkv_bias = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias] if self.blocks.qkv_bias else None
        o_bias = [a.o_proj.bias] if self.blocks.o_bias else None
        moe = self.blocks.mlp_kind(index) == "moe"
        mlp_params = self._moe_params(m) if moe else [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
        params = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, a.q_proj.weight,
                  a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, *mlp_params, *(qkv_bias or []), *(o_bias or [])]
        if self.blocks.qk_norm:
            params += [a.q_norm.weight, a.k_norm.weight]
        adapter = PeftLayerAdapter(layer, self.lora_config) if self.lora_config is not None else None
        if adapter is not None:
            params += adapter.parameters()
        rt, eps = self.runtime, self.eps

        def build():
            ops = dict(
                input_norm=AlignedRMSNorm(rt, layer.input_layernorm.weight, eps),
                post_norm=AlignedRMSNorm(rt, layer.post_attention_layernorm.weight, eps),
                qkv=AlignedLinear(rt, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], qkv_bias),
                o=AlignedLinear(rt, [a.o_proj.weight], o_bias),
            )
            if moe:
                ops.update(self._moe_ops(m))
            else:
                ops.update(gate_up=AlignedLinear(rt, [m.gate_proj.weight, m.up_proj.weight]),
                           down=AlignedLinear(rt, [m.down_proj.weight]))
            if self.blocks.qk_norm:
                ops["q_norm"] = AlignedRMSNorm(rt, a.q_norm.weight, eps)
                ops["k_norm"] = AlignedRMSNorm(rt, a.k_norm.weight, eps)
            if adapter is not None:
                from zero_mismatch_plugin.aligned.lora.ops import lora_linears

                ops.update(lora_linears(rt, adapter, [ops], mapping=self.lora_mapping)[0])
            return ops

        return self._cached(layer, params, build)

    def _moe_params(self, block) -> list:
        """The tensors an HF MoE block computes from: router, stacked experts, correction bias,
        shared expert and its gate (transformers' names: ``mlp.gate``, ``mlp.experts``)."""
        import torch

        experts = block.experts
        stacked = [getattr(experts, name, None) for name in ("gate_up_proj", "down_proj")]
        if any(not isinstance(w, torch.Tensor) or w.dim() != 3 for w in stacked):
            raise UnsupportedFSDPFeature(
                f"{self.blocks.architecture}: the aligned FSDP actor forward reads transformers' stacked expert "
                f"weights (mlp.experts.gate_up_proj [experts, 2 x width, hidden], mlp.experts.down_proj); this "
                f"model's experts are a {type(experts).__name__}: use transformers >= 5, or set {FSDP_ALIGNED}=0")
        params = [block.gate.weight, *stacked, getattr(block.gate, "e_score_correction_bias", None)]
        moe = self.blocks.moe
        if moe.shared_expert_intermediate_size:
            from zero_mismatch_plugin.tables.architectures import MOE_CHECKPOINT_NAMES

            shared = getattr(block, MOE_CHECKPOINT_NAMES[moe.names][3])
            params += [shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight]
            if moe.shared_expert_gate:
                params.append(block.shared_expert_gate.weight)
        return params

    def _moe_ops(self, block) -> dict:
        """The op layer's MoE op over one HF MoE block's gathered parameters (transformers'
        stacked experts, handed to the op as one view per expert)."""
        from zero_mismatch_plugin.faces.aligned_model import moe_block_ops
        from zero_mismatch_plugin.aligned.moe import AlignedMoE

        gate_up, down = self._expert_views(block.experts)
        experts = AlignedMoE(self.runtime, self.blocks.moe, self.config.hidden_size, None, None, down,
                             getattr(block.gate, "e_score_correction_bias", None), gate_up=gate_up)
        return moe_block_ops(self.runtime, self.blocks.moe, block, block.gate, experts)

    @staticmethod
    def _expert_views(experts) -> tuple[list, list]:
        """Per-expert views ([gate; up] and down) of transformers' stacked expert parameters."""
        return list(experts.gate_up_proj.unbind(0)), list(experts.down_proj.unbind(0))

    def _moe_call(self, op, experts):
        """``op`` differentiating into views of ``experts``' stacked parameters taken now. Views
        kept from an earlier forward would put their backward behind FSDP2's post-backward
        reduction of the layer (autograd runs ready nodes newest first), and the expert gradients
        would arrive after the reduce-scatter: lost (measured: no gradient on the shards)."""
        gate_up, down = self._expert_views(experts)
        params = gate_up + down
        return lambda hidden, router_logits: op(hidden, router_logits, params)

    def norm_ops(self, root) -> dict:
        from zero_mismatch_plugin.aligned.ops import AlignedRMSNorm

        weight = root.model.norm.weight
        return self._cached(root.model.norm, [weight],
                            lambda: dict(final_norm=AlignedRMSNorm(self.runtime, weight, self.eps)))

    def head_ops(self, owner, weight) -> dict:
        from zero_mismatch_plugin.aligned.ops import AlignedLogits

        return self._cached(owner, [weight],
                            lambda: dict(logits=AlignedLogits(self.runtime, weight, self.config.vocab_size)))

    # ----- the unit forwards (installed as instance forwards for one call) -------------------

    def decoder_layer_forward(self, index, layer, hidden, residual, positions, plan, seq_lens):
        """One decoder layer in vLLM's order: [fused add] norm, qkv, [q/k norm], rotary,
        attention, o, fused add norm, then the MLP (gate_up, SiluAndMul, down; or router, routed
        experts and any shared expert)."""
        ops = self.layer_ops(index, layer)
        if "experts" in ops:
            ops = {**ops, "experts": self._moe_call(ops["experts"], layer.mlp.experts)}

        def linear(name, x):
            return ops[name](x)

        return self.decoder_layer(
            ops, hidden, residual, positions, self.heads, self.rotary,
            linear=linear,
            attend=lambda q, k, v: self.attention(q, k, v, plan, seq_lens),
            mlp=partial(self.layer_mlp, ops, self.act, linear),
        )

    def lm_head_forward(self, lm_head, hidden):
        return self.head_ops(lm_head, lm_head.weight)["logits"](hidden)

    def root_forward(self, root, input_ids, positions, seq_lens):
        """Logits [T, vocab] of every packed row (the root's FSDP unit is gathered here)."""
        root = causal_lm(root)
        embed = root.model.embed_tokens
        hidden = embed(input_ids)
        if hidden.dtype != self.runtime.dtype:
            hidden = hidden.to(self.runtime.dtype)
        plan = self.attention.plan(seq_lens)
        residual = None
        for layer in root.model.layers:
            hidden, residual = layer(hidden, residual, positions, plan, seq_lens)
        hidden, _ = self.norm_ops(root)["final_norm"](hidden, residual)
        if self.blocks.tied_head:
            return self.head_ops(root.lm_head, embed.weight)["logits"](hidden)
        return root.lm_head(hidden)

    def install(self, root) -> None:
        """The unit forwards as instance attributes of the modules, from now until :func:`uninstall`.

        They stay after the call: with gradient checkpointing (verl's default,
        ``enable_gradient_checkpointing``) the backward calls each decoder layer again to
        recompute its activations, and must reach the aligned forward then too."""
        model = causal_lm(root)
        modules = [(root, partial(self.root_forward, root))]
        modules += [(layer, partial(self.decoder_layer_forward, i, layer)) for i, layer in enumerate(model.model.layers)]
        if not self.blocks.tied_head:
            modules.append((model.lm_head, partial(self.lm_head_forward, model.lm_head)))
        for module, forward in modules:
            module.forward = forward
        _installed[root] = [module for module, _ in modules]

    def logits(self, root, batch: PackedMicroBatch) -> torch.Tensor:
        if root not in _installed:
            self.install(root)
        return root(batch.input_ids, batch.positions, batch.seq_lens)


def causal_lm(root):
    """The HF causal LM of verl's root module: the module itself, or the one PEFT wraps."""
    get_base_model = getattr(root, "get_base_model", None)
    return get_base_model() if get_base_model is not None else root


# ----- PEFT: the adapter verl put on the decoder, as the op layer reads adapters -------------


class PeftLayerAdapter:
    """One decoder layer's PEFT LoRA modules as the adapter :func:`~zero_mismatch_plugin.aligned.lora.ops.lora_linears`
    reads: ``pair(layer, target)`` with ``lora_A`` / ``lora_B`` the module's own (gathered) parameters."""

    def __init__(self, layer, lora_config):
        self.layer = layer
        self.lora_config = lora_config

    def pair(self, _layer_index: int, target: str):
        from types import SimpleNamespace

        from zero_mismatch_plugin.aligned.lora.names import ATTENTION_TARGETS

        module = getattr(self.layer.self_attn if target in ATTENTION_TARGETS else self.layer.mlp, target, None)
        lora_a = getattr(module, "lora_A", {})
        if PEFT_ADAPTER not in lora_a:
            return None
        scaling = module.scaling[PEFT_ADAPTER]
        if scaling != self.lora_config.scaling:
            raise UnsupportedFSDPFeature(f"{target}: PEFT scales the adapter by {scaling}, vLLM by "
                                         f"{self.lora_config.scaling}; use one lora_alpha and rank for every module")
        return SimpleNamespace(lora_A=lora_a[PEFT_ADAPTER].weight, lora_B=module.lora_B[PEFT_ADAPTER].weight)

    def parameters(self) -> list:
        from zero_mismatch_plugin.aligned.lora.names import ALIGNED_LORA_TARGETS

        pairs = [self.pair(0, target) for target in ALIGNED_LORA_TARGETS]
        return [t for p in pairs if p is not None for t in (p.lora_A, p.lora_B)]

    def shared_expert_pairs(self, _layer_index: int):
        return None

    def expert_pairs(self, _layer_index: int):
        return None


def peft_lora_config(root):
    """The :class:`~zero_mismatch_plugin.aligned.lora.peft.LoRAConfig` of the PEFT adapter verl put on
    ``root`` (None without one); refuses what vLLM would not serve as the trainer computes it."""
    from zero_mismatch_plugin.aligned.lora.names import supported_lora_targets
    from zero_mismatch_plugin.aligned.lora.peft import LoRAConfig, unsupported_lora_settings

    peft_config = getattr(root, "peft_config", {}).get(PEFT_ADAPTER)
    if peft_config is None:
        return None
    raw = peft_config.to_dict()
    raw["peft_type"] = getattr(raw.get("peft_type"), "value", raw.get("peft_type"))
    targets = raw.get("target_modules")
    if isinstance(targets, (set, frozenset, list, tuple)):
        # PEFT resolves "all-linear" to module paths (model.layers.0.mlp.down_proj): the names they end in.
        raw["target_modules"] = sorted({name.rsplit(".", 1)[-1] for name in targets})
    problems = unsupported_lora_settings(raw, supported_lora_targets(causal_lm(root).config))
    if raw.get("target_parameters"):
        problems.append(f"target_parameters={raw['target_parameters']}: LoRA on fused expert tensors is not "
                        "covered by the aligned FSDP forward; set actor_rollout_ref.model.target_parameters=null")
    if raw.get("lora_dropout"):
        problems.append(f"lora_dropout={raw['lora_dropout']}: the training forward would drop adapter inputs the "
                        "rollout never drops; train with lora_dropout=0")
    if len(root.peft_config) != 1:
        problems.append(f"adapters {sorted(root.peft_config)}: one adapter ({PEFT_ADAPTER!r}) only")
    if problems:
        raise UnsupportedFSDPFeature(f"{FSDP_ALIGNED}=1 but the actor's LoRA adapter has " + "; ".join(problems)
                                     + f". Fix these or unset {FSDP_ALIGNED} (diff 0 then cannot hold).")
    return LoRAConfig(r=raw["r"], lora_alpha=raw["lora_alpha"], targets=tuple(raw["target_modules"]),
                      use_rslora=bool(raw.get("use_rslora")))


# ----- installed unit forwards, and the logprobs of their logits ---------------------------


# root module -> the modules that carry an aligned unit forward (removed again by uninstall)
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def uninstall(root) -> None:
    """Give ``root``'s units their own (HF) forwards back."""
    for module in _installed.pop(root, ()):
        module.__dict__.pop("forward", None)


def uninstall_all() -> None:
    """Give every module the aligned forward ran on its own forward back."""
    for root in list(_installed):
        uninstall(root)


def aligned_log_probs(logits: torch.Tensor, batch: PackedMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(vLLM's logprob of each row's label at the row's temperature, the scaled logits)."""
    from zero_mismatch_plugin.aligned.sampling import gather_labels, vllm_logprobs, vllm_scaled_logits

    scaled = vllm_scaled_logits(logits, batch.temperature)
    return gather_labels(vllm_logprobs(scaled), batch.labels), scaled

