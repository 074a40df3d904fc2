"""The trainable adapter: A and B of every target of every layer, in PEFT's layout and names."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from zero_mismatch_plugin.aligned.lora.fused_experts import FusedExpertLoRA
from zero_mismatch_plugin.aligned.lora.names import EXPERT_TARGETS, PEFT_VOCAB_NAMES, expert_target_names
from zero_mismatch_plugin.aligned.lora.names import is_peft_lora_tensor_name, moe_checkpoint_names
from zero_mismatch_plugin.aligned.lora.names import peft_expert_module_name, peft_shared_expert_module_name
from zero_mismatch_plugin.aligned.lora.names import peft_tensor_name, supported_lora_targets
from zero_mismatch_plugin.aligned.lora.peft import WEIGHTS_FILE, LoRAConfig, read_lora_config
from zero_mismatch_plugin.aligned.lora.peft import unsupported_lora_settings, write_peft_adapter
from zero_mismatch_plugin.aligned.lora.targets import LoRAPair, layer_has_target, routed_expert_layers, target_shapes
from zero_mismatch_plugin.tables.architectures import VOCAB_LORA_TARGETS, describe


def _expert_module(r: int, shapes: dict[str, tuple[int, int]]) -> nn.Module:
    expert = nn.Module()
    for target, (out_f, in_f) in shapes.items():
        setattr(expert, target, LoRAPair(r, in_f, out_f))
    return expert


class LoRAAdapter(nn.Module):
    """The trainable A [r, in] and B [out, r] of every target of every layer (fp32, PEFT layout).

    Parameters are named ``layers.{i}.{target}.lora_A`` / ``lora_B``, and ``embed_tokens.lora_A``
    [r, vocab] / ``lora_B`` [hidden, r] (PEFT's ``lora_embedding_A`` / ``_B``), ``lm_head.lora_A``
    [r, hidden] / ``lora_B`` [vocab, r]; :meth:`save` writes them under PEFT's names. In a
    Mixture-of-Experts layer the MLP targets are those of every routed expert
    (``layers.{i}.experts.{e}.{target}``, see :data:`EXPERT_TARGETS`) and of the shared expert; for a
    3-D expert adapter (``target_parameters``) PEFT's fused tensors of the layer's routed experts
    (``layers.{i}.experts.gate_up_proj`` / ``down_proj``, :class:`~.fused_experts.FusedExpertLoRA`).
    """

    def __init__(self, lora_config: LoRAConfig, model_config, head_dim: int):
        super().__init__()
        self.lora_config = lora_config
        shapes = target_shapes(model_config, head_dim)
        # Parameters are named by EXPERT_TARGETS whatever the checkpoint calls an expert's linears.
        canonical = dict(zip(expert_target_names(model_config), EXPERT_TARGETS))
        self.model_config = model_config
        # (Kimi names its dense MLP's linears gate_proj ... and its experts' w1 ...: both are one target each.)
        self.layer_targets = tuple(dict.fromkeys(canonical.get(t, t) for t in lora_config.targets
                                                 if t not in VOCAB_LORA_TARGETS))
        expert_targets = [t for t in self.layer_targets if t in EXPERT_TARGETS]
        fused_experts = bool(lora_config.target_parameters)
        moe_layers, expert_shapes, self.shared_name, shared_shapes = routed_expert_layers(model_config)
        block = (moe_checkpoint_names(model_config) or [None])[0] if moe_layers else None
        self.moe_block = block or "mlp"
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
        blocks = describe(model_config)
        self.layers = nn.ModuleList()
        for index in range(model_config.num_hidden_layers):
            layer = nn.Module()
            for target in self.layer_targets:
                if index in moe_layers and target in EXPERT_TARGETS:
                    continue
                if not layer_has_target(blocks, index, target):
                    continue
                out_f, in_f = shapes[target]
                setattr(layer, target, LoRAPair(lora_config.r, in_f, out_f))
            if index in moe_layers and expert_targets:
                layer.experts = nn.ModuleList(_expert_module(lora_config.r, expert_shapes) for _ in range(moe_layers[index]))
                if self.shared_name:
                    layer.shared_expert = _expert_module(lora_config.r, shared_shapes)
            elif index in moe_layers and fused_experts:
                layer.experts = FusedExpertLoRA(lora_config.r, moe_layers[index], expert_shapes)
            self.layers.append(layer)
        vocab, hidden = model_config.vocab_size, model_config.hidden_size
        vocab_shapes = {"embed_tokens": (hidden, vocab), "lm_head": (vocab, hidden)}
        for target in lora_config.targets:
            if target in VOCAB_LORA_TARGETS:
                out_f, in_f = vocab_shapes[target]
                setattr(self, target, LoRAPair(lora_config.r, in_f, out_f))

    def vocab_pair(self, target: str) -> LoRAPair | None:
        """The adapter of ``embed_tokens`` or ``lm_head``, or None."""
        return getattr(self, target, None) if target in self.lora_config.targets else None

    def named_matrices(self):
        """(PEFT name, parameter) of every A and B."""
        for i, target, pair in self.pairs():
            yield peft_tensor_name(i, target, "A"), pair.lora_A
            yield peft_tensor_name(i, target, "B"), pair.lora_B
        for i in range(len(self.layers)):
            experts = getattr(self.layers[i], "experts", None)
            if isinstance(experts, FusedExpertLoRA):  # a 3-D expert adapter: PEFT's fused tensors
                yield from experts.named_matrices(i)
            routed = [] if isinstance(experts, FusedExpertLoRA) else self.expert_pairs(i) or []
            modules = [(peft_expert_module_name(i, e, t, self.model_config), pair)
                       for e, targets in enumerate(routed) for t, pair in targets.items()]
            modules += [(peft_shared_expert_module_name(i, self.shared_name, t, self.moe_block), pair)
                        for t, pair in (self.shared_expert_pairs(i) or {}).items()]
            for module, pair in modules:
                yield f"{module}.lora_A.weight", pair.lora_A
                yield f"{module}.lora_B.weight", pair.lora_B
        for target in VOCAB_LORA_TARGETS:
            pair = self.vocab_pair(target)
            if pair is not None:
                yield PEFT_VOCAB_NAMES[target][0], pair.lora_A
                yield PEFT_VOCAB_NAMES[target][1], pair.lora_B

    def pair(self, layer: int, target: str) -> LoRAPair | None:
        return getattr(self.layers[layer], target, None)

    def pairs(self):
        """(layer, target, pair) of every decoder-layer target."""
        for i, layer in enumerate(self.layers):
            for target in self.layer_targets:
                pair = getattr(layer, target, None)
                if pair is not None:
                    yield i, target, pair

    def expert_pairs(self, layer: int) -> list[dict[str, LoRAPair]] | None:
        """The adapter of each routed expert of MoE layer ``layer`` ({target: pair}), or None."""
        experts = getattr(self.layers[layer], "experts", None)
        if isinstance(experts, FusedExpertLoRA):  # a 3-D expert adapter: views of its fused tensors
            return experts.expert_pairs()
        return None if experts is None else [{t: getattr(m, t) for t in EXPERT_TARGETS} for m in experts]

    def shared_expert_pairs(self, layer: int) -> dict[str, LoRAPair] | None:
        """The adapter of MoE layer ``layer``'s shared expert ({target: pair}), or None."""
        shared = getattr(self.layers[layer], "shared_expert", None)
        return None if shared is None else {t: getattr(shared, t) for t in EXPERT_TARGETS}

    def peft_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().contiguous() for name, p in self.named_matrices()}

    def load_peft_state(self, state: dict[str, torch.Tensor], where: str = "adapter") -> None:
        expected = dict(self.named_matrices())
        unexpected = sorted(set(state) - set(expected))
        missing = sorted(set(expected) - set(state))
        if unexpected or missing:
            hint = [n for n in unexpected if not is_peft_lora_tensor_name(n)]
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
    from zero_mismatch_plugin.aligned.checkpoint import read_config

    model_config = read_config(model_dir)
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


# How a fresh adapter's A is drawn, by the name verl's Megatron LoRA settings give it
# (``lora_A_init_method``): xavier uniform, or kaiming uniform with a = sqrt(5) (PEFT's own).
A_INITS = {
    "xavier": lambda a, gen: nn.init.xavier_uniform_(a, generator=gen),
    "kaiming": lambda a, gen: nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen),
}


def initial_adapter(adapter_dir: str | os.PathLike, model_config, lora_config: LoRAConfig, a_init: str = "xavier",
                    seed: int = 0) -> Path:
    """Write the adapter a LoRA run starts from: every A drawn by ``a_init`` (:data:`A_INITS`), every
    B zero, so the adapted model starts as the base model. Ranks drawing with one ``seed`` write the
    same adapter (each then keeps its part of it)."""
    if a_init not in A_INITS:
        raise ValueError(f"lora_A_init_method {a_init!r}: use one of {sorted(A_INITS)}")
    problems = unsupported_lora_settings(lora_config.as_peft_dict(), supported_lora_targets(model_config, vocab=True))
    if problems:
        raise ValueError("; ".join(problems))
    adapter = LoRAAdapter(lora_config, model_config, describe(model_config).head_dim)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if name.endswith("lora_A"):
                A_INITS[a_init](param, gen)
            else:
                param.zero_()
    return adapter.save(adapter_dir)
