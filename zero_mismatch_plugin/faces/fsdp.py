"""Runtime patch of verl's FSDP engine: the actor's logprobs from vLLM's kernels.

Enabled by ``ZMRL_FSDP_ALIGNED=1`` in every verl process (:func:`maybe_apply`, called by the
plugin's ``verl.plugins`` entry point) or by :func:`apply`; :func:`remove` puts verl's methods
back. The patches are :class:`~zero_mismatch_plugin.integrations.patches.FunctionPatch` entries for
the verl versions in :data:`SUPPORTED_VERL_VERSIONS` (any other is refused).

What changes in ``verl.workers.engine.fsdp.transformer_impl``:

* ``FSDPEngineWithLMHead.forward_step``: for an actor (not a value model) whose checkpoint is one
  of :mod:`~zero_mismatch_plugin.tables.architectures`' decoders, the HF module's own forward is not
  called. The micro-batch's sequences are packed (``input_ids`` / ``position_ids`` of verl's
  no-padding layout) and run through the op layer (:mod:`~zero_mismatch_plugin.aligned.ops`) in
  vLLM's layer order, over the FSDP module's parameters, and the logprob tail
  (:mod:`~zero_mismatch_plugin.aligned.sampling`) turns the logits into vLLM's sampled-token
  logprob at each row's temperature. Both the no-grad recompute of old logprobs and the training
  forward take this path; verl's loss function is then called exactly as verl calls it.
  Mixture-of-Experts layers run the op layer's MoE op (vLLM's router and fused-experts layer) on
  the layer's gathered expert weights: an FSDP unit holds every expert of its layer while it runs,
  so the experts compute in one process as vLLM's one-process MoE layer does (no expert
  parallelism).
* ``FSDPEngine.optimizer_step`` / ``load_checkpoint``: afterwards the engine-layout weight copies
  (merged qkv, packed oneDNN handles) are marked stale and re-derived at the next forward. FSDP2
  refills its gathered parameters without bumping their version counters (measured: version 0
  throughout), in storage the allocator may hand out at the same address again, so
  :class:`~zero_mismatch_plugin.aligned.derived.DerivedWeight`'s own check cannot be relied on.

With a LoRA adapter (``actor_rollout_ref.model.lora_rank > 0``: verl wraps the HF model with
PEFT before FSDP), each targeted linear runs as vLLM's LoRA linear
(:class:`~zero_mismatch_plugin.aligned.lora.AlignedLoRALinear`) over the PEFT module's own
parameters: the frozen ``base_layer.weight`` and the trainable ``lora_A.default.weight`` /
``lora_B.default.weight``, B scaled by PEFT's ``alpha / r`` (or ``alpha / sqrt(r)``), which is
vLLM's scaling of the adapter verl syncs to the rollout unmerged. Dense decoders only; adapter
settings vLLM does not serve as trained (dropout, DoRA, biases, ``modules_to_save``, other
targets) and ``lora.merge=true`` (the rollout then serves merged weights) are refused.

How the op layer meets FSDP2: the aligned forward runs *inside* the FSDP units' forwards. For the
duration of one call, the root module, every decoder layer and (untied) ``lm_head`` get an
instance ``forward`` that computes their part with the aligned ops; calling the root module then
fires FSDP2's hooks unit by unit, so each unit's parameters are gathered while its ops run,
gradients land on the gathered parameters and FSDP reduces them into the shards verl's optimizer
steps, as for verl's own forward.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from functools import partial, wraps

from zero_mismatch_plugin.tables import upstream_versions
from zero_mismatch_plugin.integrations.patches import patch_at
from zero_mismatch_plugin.integrations.patches import apply as apply_patch
from zero_mismatch_plugin.integrations.patches import is_applied, is_pending
from zero_mismatch_plugin.integrations.patches import remove as remove_patch

logger = logging.getLogger("zero_mismatch_plugin")

ENABLE_ENV = "ZMRL_FSDP_ALIGNED"
SUPPORTED_VERL_VERSIONS = upstream_versions.VERL
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
PEFT_ADAPTER = "default"  # the adapter name verl's get_peft_model / PeftModel.from_pretrained give

_STATE_ATTR = "_zmrl_fsdp_aligned"
_GENERATION_ATTR = "_zmrl_weights_generation"


class UnsupportedFSDPFeature(NotImplementedError):
    """A setting of verl's FSDP engine under which the aligned forward cannot reproduce vLLM."""


def enabled_by_env() -> bool:
    """``"1"`` on, ``"0"`` or unset off; any other value raises (:mod:`zero_mismatch_plugin.tables.switches`)."""
    from zero_mismatch_plugin.tables.switches import enabled

    return enabled(ENABLE_ENV)


# ----- packed inputs from verl's micro-batch ------------------------------------------------


@dataclass
class PackedMicroBatch:
    """One micro-batch in vLLM's packed layout, with verl's per-token labels and temperatures."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    seq_lens: list[int]
    cu_seqlens: torch.Tensor  # [B + 1], verl's offsets of the jagged tensors
    labels: torch.Tensor  # [T] the next token (verl's rolled input_ids; the last row of a sequence is unused)
    temperature: torch.Tensor  # [T] fp32, the sampling temperature of each row's sequence


def packed_micro_batch(micro_batch) -> PackedMicroBatch:
    """verl's no-padding micro-batch (jagged ``input_ids`` / ``position_ids``) as one packed batch."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise UnsupportedFSDPFeature(f"the aligned FSDP forward reads verl's no-padding batches; got pad_mode {pad_mode}")
    input_ids = micro_batch["input_ids"]
    position_ids = micro_batch["position_ids"]
    if position_ids.dim() == 3:
        raise UnsupportedFSDPFeature("multi-dimensional (mrope) position_ids: vision-language models are not covered")
    ids = input_ids.values()
    cu_seqlens = input_ids.offsets().to(torch.long)
    seq_lens = [int(n) for n in cu_seqlens.diff().tolist()]
    temperature = micro_batch["temperature"]
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.full((len(seq_lens),), float(temperature))
    temperature = temperature.to(device=ids.device, dtype=torch.float32).reshape(-1)
    if temperature.numel() != len(seq_lens):
        raise ValueError(f"one temperature per sequence expected, got {temperature.numel()} for {len(seq_lens)}")
    # verl's guard for padding rows (temperature 0 would divide by zero).
    temperature = temperature.clamp(min=1e-8)
    return PackedMicroBatch(
        input_ids=ids,
        positions=position_ids.values().to(torch.long),
        seq_lens=seq_lens,
        cu_seqlens=cu_seqlens,
        labels=torch.roll(ids, shifts=-1, dims=0),
        temperature=temperature.repeat_interleave(torch.tensor(seq_lens, device=ids.device)),
    )


# ----- the aligned forward over an HF decoder's (FSDP) parameters ---------------------------


def _param_key(tensors) -> tuple:
    return tuple(id(t) for t in tensors if t is not None)


class AlignedFSDPForward:
    """The op layer over the parameters of one HF decoder (``model.layers``, ``model.norm``,
    ``model.embed_tokens``, ``lm_head``: the checkpoint names the aligned model uses too).

    The ops are built from the parameter objects the modules hold while their FSDP unit is
    gathered, rebuilt if FSDP hands out other objects, and their engine-layout weights
    re-derived when :meth:`mark_stale` was called (after optimizer steps and checkpoint loads).
    """

    def __init__(self, runtime, hf_config, lora_config=None):
        from zero_mismatch_plugin.aligned.lora import _TokenMapping
        from zero_mismatch_plugin.faces.aligned_model import AttentionHeads, decoder_layer, layer_mlp, rotary_parameters
        from zero_mismatch_plugin.aligned.ops import AlignedAttention, AlignedRotary, AlignedSiluAndMul
        from zero_mismatch_plugin.tables.architectures import describe

        self.runtime = runtime
        self.config = hf_config
        self.blocks = describe(hf_config)
        # The aligned model covers these; this face's layer forward does not run them yet.
        missing = (["sliding-window attention"] if self.blocks.sliding_windows else []) + (
            ["multi-head latent attention"] if self.blocks.attention == "mla" else [])
        if lora_config is not None and any(
                self.blocks.mlp_kind(i) == "moe" for i in range(hf_config.num_hidden_layers)):
            missing.append("LoRA adapters on Mixture-of-Experts layers")
        if missing:
            raise NotImplementedError(
                f"{self.blocks.architecture}: the aligned FSDP actor forward does not cover "
                f"{' and '.join(missing)} yet; set {ENABLE_ENV}=0 to train with verl's own forward.")
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
        self.lora_mapping = _TokenMapping(runtime) if lora_config is not None else None
        self._ops: dict[int, tuple[tuple, dict]] = {}  # id(module) -> (parameter key, ops)
        self._stale: set[int] = set()
        self._probed: set[tuple] = set()
        self.generation = 0  # the engine's weights generation the ops were derived at

    def mark_stale(self) -> None:
        """The sharded weights changed: re-derive every engine-layout copy at its next use."""
        self._stale = set(self._ops)

    def _cached(self, module, params, build) -> dict:
        key = _param_key(params)
        entry = self._ops.get(id(module))
        if entry is None or entry[0] != key:
            entry = (key, build())
            self._ops[id(module)] = entry
            self._check_gemms(entry[1])
        elif id(module) in self._stale:
            for op in entry[1].values():
                for part in (op, getattr(op, "base", None)):  # a LoRA op's adapter, then its base
                    derived = getattr(part, "derived", None) or getattr(part, "engine_weight", None)
                    if derived is not None:
                        derived.refresh()
        self._stale.discard(id(module))
        return entry[1]

    def _check_gemms(self, ops: dict) -> None:
        """On CPU in consistent mode, refuse a GEMM whose rows depend on the row count (the engine
        computes a row in batches of other sizes), as the aligned model does."""
        from zero_mismatch_plugin.aligned import numerics
        from zero_mismatch_plugin.aligned.cpu_gemm import probe_linear, require_invariant
        from zero_mismatch_plugin.aligned.ops import AlignedLinear, AlignedLogits

        if self.runtime.platform != "cpu" or not numerics.is_consistent():
            return
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
        adapter = _PeftLayerAdapter(layer, self.lora_config) if self.lora_config is not None else None
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
                from zero_mismatch_plugin.aligned.lora import lora_linears

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
                f"model's experts are a {type(experts).__name__}: use transformers >= 5, or set {ENABLE_ENV}=0")
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


class _PeftLayerAdapter:
    """One decoder layer's PEFT LoRA modules as the adapter :func:`~zero_mismatch_plugin.aligned.lora.lora_linears`
    reads: ``pair(layer, target)`` with ``lora_A`` / ``lora_B`` the module's own (gathered) parameters."""

    def __init__(self, layer, lora_config):
        self.layer = layer
        self.lora_config = lora_config

    def pair(self, _layer_index: int, target: str):
        from types import SimpleNamespace

        from zero_mismatch_plugin.aligned.lora import ATTENTION_TARGETS

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
        from zero_mismatch_plugin.aligned.lora import ALIGNED_LORA_TARGETS

        pairs = [self.pair(0, target) for target in ALIGNED_LORA_TARGETS]
        return [t for p in pairs if p is not None for t in (p.lora_A, p.lora_B)]

    def shared_expert_pairs(self, _layer_index: int):
        return None

    def expert_pairs(self, _layer_index: int):
        return None


def peft_lora_config(root):
    """The :class:`~zero_mismatch_plugin.aligned.lora.LoRAConfig` of the PEFT adapter verl put on
    ``root`` (None without one); refuses what vLLM would not serve as the trainer computes it."""
    from zero_mismatch_plugin.aligned.lora import LoRAConfig, supported_lora_targets, unsupported_lora_settings

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
        raise UnsupportedFSDPFeature(f"{ENABLE_ENV}=1 but the actor's LoRA adapter has " + "; ".join(problems)
                                     + f". Fix these or unset {ENABLE_ENV} (diff 0 then cannot hold).")
    return LoRAConfig(r=raw["r"], lora_alpha=raw["lora_alpha"], targets=tuple(raw["target_modules"]),
                      use_rslora=bool(raw.get("use_rslora")))


# root module -> the modules that carry an aligned unit forward (removed again by uninstall / remove)
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def uninstall(root) -> None:
    """Give ``root``'s units their own (HF) forwards back."""
    for module in _installed.pop(root, ()):
        module.__dict__.pop("forward", None)


def aligned_log_probs(logits: torch.Tensor, batch: PackedMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(vLLM's logprob of each row's label at the row's temperature, the scaled logits)."""
    from zero_mismatch_plugin.aligned.sampling import gather_labels, vllm_logprobs, vllm_scaled_logits

    scaled = vllm_scaled_logits(logits, batch.temperature)
    return gather_labels(vllm_logprobs(scaled), batch.labels), scaled


# ----- the engine side ----------------------------------------------------------------------


def _unwrapped(module):
    return getattr(module, "_fsdp_wrapped_module", module)


def check_engine_supported(engine) -> None:
    """Refuse the engine settings the aligned forward does not reproduce, naming what to change."""
    problems = []
    lora_sync = getattr(getattr(engine, "model_config", None), "lora", None) or {}
    if getattr(engine, "_is_lora", False) and lora_sync.get("merge", False):
        problems.append("LoRA synced merged (the rollout serves W + s BA, not the adapter the aligned forward "
                        "runs): set actor_rollout_ref.model.lora.merge=false")
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        problems.append("Ulysses sequence parallelism: set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1")
    if getattr(engine, "_qat_enabled", False):
        problems.append("quantization-aware training: turn off actor_rollout_ref.actor.fsdp_config.qat.enable")
    if getattr(engine.engine_config, "strategy", "fsdp2") not in ("fsdp2", None):
        problems.append(f"strategy {engine.engine_config.strategy!r}: the aligned forward runs on FSDP2 "
                        "(fully_shard) units; set actor_rollout_ref.actor.strategy=fsdp2")
    if problems:
        raise UnsupportedFSDPFeature(f"{ENABLE_ENV}=1 but verl's FSDP engine runs with " + "; ".join(problems)
                                     + f". Fix these or unset {ENABLE_ENV} (diff 0 then cannot hold).")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def aligned_state(engine) -> AlignedFSDPForward:
    """The engine's aligned forward, built on first use from the checkpoint the actor loaded, in
    the dtype its forward computes in (the rollout must serve the same checkpoint in that dtype)."""
    state = getattr(engine, _STATE_ATTR, None)
    if state is None:
        from zero_mismatch_plugin.aligned import numerics
        from zero_mismatch_plugin.aligned.runtime import VllmRuntime

        check_engine_supported(engine)
        if numerics.is_consistent():
            # The trainer side of the switch in the actor's worker, kept for the worker's life
            # (vLLM's batch-invariant mode on a GPU; on a CPU the trainer follows ZMRL_NUMERICS).
            numerics.enable_consistent_numerics()
        root = _unwrapped(engine.module)
        dtype = getattr(engine, "_autocast_dtype", None) or next(root.parameters()).dtype
        lora_config = peft_lora_config(root)
        lora_args = {}
        if lora_config is not None:
            from zero_mismatch_plugin.aligned.lora import lora_engine_args_for_rank

            lora_args = lora_engine_args_for_rank(lora_config.r)  # the rollout's max_lora_rank (verl's rule)
        runtime = VllmRuntime(engine.model_config.local_path, dtype=_dtype_name(dtype), **lora_args)
        state = AlignedFSDPForward(runtime, causal_lm(root).config, lora_config)
        setattr(engine, _STATE_ATTR, state)
        logger.warning("zero-mismatch: verl FSDP actor (%s, %s): logprobs from vLLM's kernels (%s)",
                       state.blocks.architecture, _dtype_name(dtype), runtime.platform)
    if getattr(engine, _GENERATION_ATTR, 0) != state.generation:
        state.mark_stale()
        state.generation = getattr(engine, _GENERATION_ATTR, 0)
    return state


def _micro_batch_problems(micro_batch) -> list[str]:
    from verl.utils import tensordict_utils as tu

    problems = []
    for key, what in (("use_fused_kernels", "actor_rollout_ref.model.use_fused_kernels=false"),
                      ("distillation_use_topk", "no top-k distillation"),
                      ("distillation_only", "no distillation-only forward")):
        if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
            problems.append(what)
    if "multi_modal_inputs" in micro_batch.keys():
        from verl.utils.model import extract_multi_modal_inputs

        # verl carries the key for text-only batches too (one empty entry per sample).
        if extract_multi_modal_inputs(micro_batch["multi_modal_inputs"]):
            problems.append("text-only inputs (no multi_modal_inputs)")
    return problems


def aligned_forward_step(engine, micro_batch, loss_function, forward_only):
    """``FSDPEngineWithLMHead.forward_step`` with the logprobs (and entropy / sum pi^2 when verl
    asks for them) from the aligned forward; returns what verl's returns."""
    import torch

    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    micro_batch = micro_batch.to(get_device_id())
    problems = _micro_batch_problems(micro_batch)
    if problems:
        raise UnsupportedFSDPFeature(f"{ENABLE_ENV}=1: the aligned FSDP forward needs " + "; ".join(problems))
    state = aligned_state(engine)
    batch = packed_micro_batch(micro_batch)
    logits = state.logits(engine.module, batch)
    log_probs, scaled = aligned_log_probs(logits, batch)
    nested = partial(torch.nested.nested_tensor_from_jagged, offsets=batch.cu_seqlens)
    model_output = {"log_probs": nested(log_probs)}
    if tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):
        model_output["entropy"] = nested(engine.compute_entropy_from_logits(scaled))
    if tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False):
        from verl.utils import torch_functional as verl_F

        model_output["sum_pi_squared"] = nested(verl_F.calculate_sum_pi_squared_from_logits(scaled))
    if loss_function is not None:
        loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                      dp_group=engine.get_data_parallel_group())
    else:
        assert forward_only, "forward_only must be True when loss_function is None"
        loss = torch.tensor(1.0, device=get_device_name())
        metrics = {}
    output = {"model_output": _detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
    return loss, output


def _detach_tree(model_output: dict) -> dict:
    return {key: value.detach() for key, value in model_output.items()}


# ----- the patches --------------------------------------------------------------------------


def _is_actor_engine(engine) -> bool:
    import importlib

    return not isinstance(engine, importlib.import_module(ENGINE_MODULE).FSDPEngineWithValueHead)


def _aligned_forward_step(original):
    @wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        if not _is_actor_engine(self):
            return original(self, micro_batch, loss_function, forward_only)
        return aligned_forward_step(self, micro_batch, loss_function, forward_only)

    return forward_step


def _new_weights_after(original):
    @wraps(original)
    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        setattr(self, _GENERATION_ATTR, getattr(self, _GENERATION_ATTR, 0) + 1)
        return result

    return method


fsdp_patch = partial(patch_at, package="verl", versions=SUPPORTED_VERL_VERSIONS, when=f"{ENABLE_ENV}=1")

FORWARD_STEP = fsdp_patch(
    f"{ENGINE_MODULE}:FSDPEngineWithLMHead.forward_step", _aligned_forward_step, name="fsdp-aligned-forward-step",
    why="the actor's logprobs from vLLM's kernels and logprob arithmetic instead of the HF forward")
# FSDP2 refills the gathered parameters in place: the engine-layout copies are re-derived after
# every call that changes the shards.
OPTIMIZER_STEP, LOAD_CHECKPOINT = (
    fsdp_patch(f"{ENGINE_MODULE}:FSDPEngine.{method}", _new_weights_after,
               name=f"fsdp-aligned-{method.replace('_', '-')}",
               why=f"re-derive the aligned forward's engine-layout weights after {cause} changed the shards")
    for method, cause in (("optimizer_step", "the optimizer"), ("load_checkpoint", "a checkpoint")))

PATCHES = (FORWARD_STEP, OPTIMIZER_STEP, LOAD_CHECKPOINT)


def apply() -> None:
    """Install the patches (now, or when verl's FSDP engine module is imported). Idempotent."""
    for patch in PATCHES:
        apply_patch(patch)


def remove() -> None:
    """Put verl's methods back, and the HF forwards of every module the aligned forward ran on."""
    for patch in reversed(PATCHES):
        remove_patch(patch)
    for root in list(_installed):
        uninstall(root)


def is_active() -> bool:
    return all(is_applied(patch) or is_pending(patch) for patch in PATCHES)


def maybe_apply() -> bool:
    """Apply when ``ZMRL_FSDP_ALIGNED`` is set; for the plugin's verl entry point."""
    if not enabled_by_env():
        return False
    apply()
    return True
