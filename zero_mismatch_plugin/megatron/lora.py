"""LoRA in the Megatron face: a frozen GPTModel plus a trainable adapter, with vLLM's LoRA arithmetic.

Each targeted linear module (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``)
carries a :class:`MegatronLoRA` holding the adapter's A and B per vLLM output slice (names
mapped to and from PEFT's by :mod:`.convert`); its forward is the op layer's
:class:`~zero_mismatch_plugin.aligned.lora.AlignedLoRALinear` over the module's own base op, so
the update is added in vLLM's row order (before megatron's grouped-qkv permutation) and the
backward reaches A and B only. Nothing here defines an autograd op.
"""

from __future__ import annotations

import os

from torch import nn

from ..aligned.lora import LoRAAdapter, _LoRAPair, _target_shapes, _TokenMapping, AlignedLoRALinear, write_peft_adapter
from . import convert


class MegatronLoRA(nn.Module):
    """The adapter of one megatron linear: ``{target: (lora_A [r, in], lora_B [out, r])}`` for
    the PEFT targets among the linear's vLLM slices ``slices`` (sizes ``out_sizes``)."""

    def __init__(self, slices, out_sizes, pairs: dict, lora_config, mapping: _TokenMapping):
        super().__init__()
        self.slices = tuple(slices)
        self.out_sizes = list(out_sizes)
        for target, pair in pairs.items():  # parameters named <linear>.lora.<target>.lora_A / _B
            self.add_module(target, pair)
        self.targets = tuple(pairs)
        self.lora_config = lora_config
        self.mapping = mapping
        self._op = None

    def op(self, runtime, base_op):
        """vLLM's LoRA linear over ``base_op`` (rebuilt when the base op is)."""
        if self._op is None or self._op.base is not base_op:
            pairs = [getattr(self, t) if t in self.targets else None for t in self.slices]
            self._op = AlignedLoRALinear(runtime, base_op, pairs, self.lora_config, self.mapping, self.out_sizes)
        return self._op


def _linear_modules(model):
    from .modules import AlignedLinearModule

    for name, module in model.named_modules():
        if isinstance(module, AlignedLinearModule):
            yield name, module


def attach_lora(model, runtime, adapter_dir: str | os.PathLike):
    """Freeze ``model`` (a GPTModel with the aligned spec) and attach the PEFT adapter in
    ``adapter_dir`` to its linears; returns the adapter's :class:`~..aligned.lora.LoRAConfig`.

    ``runtime`` must be built with the engine's LoRA arguments (``lora_engine_args``).
    """
    hf = runtime.hf_config
    head_dim = convert.megatron_blocks(hf).head_dim
    adapter = LoRAAdapter.from_dir(adapter_dir, hf, head_dim)
    lora_config = adapter.lora_config
    tensors = convert.peft_to_megatron_lora(adapter.peft_state())
    shapes = _target_shapes(hf, head_dim)
    mapping = _TokenMapping(runtime)
    for p in model.parameters():
        p.requires_grad_(False)
    attached = set()
    for name, module in _linear_modules(model):
        prefix = name.split("decoder.", 1)[-1]
        suffix = prefix.split(".", 2)[-1]  # layers.{i}.<suffix>
        slices = convert.MEGATRON_LORA_SLICES.get(suffix)
        if slices is None:
            continue
        layer = int(prefix.split(".")[1])
        pairs = {}
        for target in slices:
            if target in lora_config.targets:
                out_f, in_f = shapes[target]
                pair = _LoRAPair(lora_config.r, in_f, out_f).to(module.weight.device)
                pair.lora_A.data.copy_(tensors[convert.megatron_lora_name(layer, target, "A")])
                pair.lora_B.data.copy_(tensors[convert.megatron_lora_name(layer, target, "B")])
                pairs[target] = pair
                attached.add((layer, target))
        if pairs:
            module.lora = MegatronLoRA(slices, [shapes[t][0] for t in slices], pairs, lora_config, mapping)
    expected = {(i, t) for i in range(hf.num_hidden_layers) for t in lora_config.targets}
    if attached != expected:
        raise ValueError(f"{adapter_dir}: no megatron linear for the adapter's {sorted(expected - attached)[:4]}")
    return lora_config


def lora_parameters(model):
    """(Megatron-face name, parameter) of every adapter matrix of ``model``."""
    return [(n, p) for n, p in model.named_parameters() if ".lora." in n]


def adapter_state(model) -> dict:
    """The model's adapter under PEFT's names (detached), what the engine loads."""
    return convert.megatron_to_peft_lora({n: p.detach() for n, p in lora_parameters(model)})


def save_adapter(model, lora_config, adapter_dir: str | os.PathLike):
    """Write the model's adapter in PEFT's format, for a ``LoRARequest`` to load."""
    return write_peft_adapter(adapter_dir, lora_config, adapter_state(model))
