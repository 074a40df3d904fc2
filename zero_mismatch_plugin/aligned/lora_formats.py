"""PEFT's 3-D expert adapters: LoRA on transformers 5's fused expert parameters.

On transformers 5 the routed experts of a Qwen-style MoE layer are two 3-D parameters,
``mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` [E, H, I]. PEFT adapts them with ``LoraConfig(target_parameters=[...])``:
one A, B pair per parameter, the two nested on the one ``experts`` module (``experts.base_layer``
holds gate_up's, ``experts`` down's), A [E·r, in] and B [out, E·r]. Expert e's update is
``s · B_e A_e`` with ``A_e = A.view(E, r, in)[e]`` and ``B_e = B.view(out, r, E)[..., e]``: gate and
up share A_e.

vLLM 0.31 serves such an adapter on a model loaded with 2-D experts only with the engine argument
``enable_mixed_moe_lora_format=True`` and ``LoRARequest(..., is_3d_lora_weight=True)`` (otherwise
the adapter's activation fails an assertion in ``FusedMoEWithLoRA.set_lora`` and the engine dies).
At load ``LoRAModelManager._convert_3d_to_2d_moe_lora`` splits it into per-expert gate, up and down
A and B (gate's and up's A both A_e; B_e's first I rows gate's, the rest up's) for the per-expert
arithmetic every 2-D adapter runs.

The trainer keeps PEFT's four tensors per MoE layer as its parameters (:class:`FusedExpertLoRA`)
and hands :class:`~.moe.AlignedMoELoRA` the same split as views of them, so its forward is the
engine's, the gradient of a shared A_e is the sum of gate's and up's (as in PEFT), and the adapter
is written back in the 3-D format after an update.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zero_mismatch_plugin.aligned.lora import CONFIG_FILE, EXPERT_TARGETS, _LoRAPair

# The fused expert parameters PEFT adapts and the module of each one's A and B in the adapter's
# tensor names: PEFT nests gate_up_proj's inside whatever the order of target_parameters (a set to
# PEFT: its written order changes with the hash seed, the nesting does not); vLLM reads
# ``base_layer`` as gate_up_proj's.
FUSED_EXPERT_MODULES = {"gate_up_proj": "mlp.experts.base_layer", "down_proj": "mlp.experts"}


def _fused_parameter(name: str) -> str | None:
    """``gate_up_proj`` / ``down_proj`` for a ``target_parameters`` entry naming the routed experts' one
    (``mlp.experts.gate_up_proj`` or the bare name), else None."""
    parent, _, leaf = name.rpartition(".")
    return leaf if leaf in FUSED_EXPERT_MODULES and (not parent or parent.endswith("experts")) else None


def unsupported_target_parameters(config: dict) -> list[str]:
    """What the aligned path does not run in a PEFT config's ``target_parameters``, with the change
    that fixes it (none for the routed experts' ``gate_up_proj`` and ``down_proj`` together)."""
    targets = config.get("target_parameters")
    if not targets:
        return []
    names = [targets] if isinstance(targets, str) else list(targets)
    fused = [_fused_parameter(name) for name in names]
    out = []
    other = [name for name, parameter in zip(names, fused) if parameter is None]
    if other:
        out.append(f"target_parameters {other}: only the routed experts' "
                   f"{[f'mlp.experts.{p}' for p in FUSED_EXPERT_MODULES]} are covered; remove the others")
    elif set(fused) != set(FUSED_EXPERT_MODULES):
        out.append(f"target_parameters {names}: vLLM serves a 3-D expert adapter on gate_up_proj and down_proj "
                   "together; target both")
    modules = config.get("target_modules") or []
    both = [t for t in ([modules] if isinstance(modules, str) else modules) if t in EXPERT_TARGETS]
    if both:
        out.append(f"target_modules {both} together with target_parameters: give the experts' adapter in one "
                   "format (3-D target_parameters, or per-expert gate_proj/up_proj/down_proj modules)")
    return out


def is_fused_expert_adapter(adapter_dir: str | os.PathLike) -> bool:
    """Whether the PEFT adapter in ``adapter_dir`` has 3-D expert tensors (``target_parameters``)."""
    return bool(json.loads((Path(adapter_dir) / CONFIG_FILE).read_text()).get("target_parameters"))


def lora_request(lora_name: str, lora_int_id: int, adapter_dir: str | os.PathLike, **kwargs):
    """vLLM's ``LoRARequest`` for the adapter in ``adapter_dir``, ``is_3d_lora_weight`` set as its
    format needs (a 3-D expert adapter is otherwise read as 2-D and the engine fails)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name, lora_int_id, str(adapter_dir),
                       is_3d_lora_weight=is_fused_expert_adapter(adapter_dir), **kwargs)


def check_engine_serves_fused_experts(runtime) -> None:
    """Refuse engine arguments under which vLLM cannot serve a 3-D expert adapter."""
    lora = runtime.vllm_config.lora_config
    if lora is None or not lora.enable_mixed_moe_lora_format:
        raise ValueError(
            "a 3-D expert adapter (target_parameters) needs enable_mixed_moe_lora_format=True in the engine's "
            "(and the trainer's) arguments, as lora_engine_args gives them, and requests with "
            "is_3d_lora_weight=True (lora_formats.lora_request)"
        )


@dataclass(frozen=True)
class ExpertLoRAView:
    """One expert's A [r, in] and B [out, r] of one linear: views of the fused parameters."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor


class FusedExpertLoRA(nn.Module):
    """PEFT's 3-D adapter of one MoE layer's routed experts, as trainable parameters in PEFT's
    layout: ``gate_up_proj`` (A [E·r, H], B [2I, E·r]) and ``down_proj`` (A [E·r, I], B [H, E·r]).

    ``shapes``: (out, in) of one expert's ``gate_proj`` / ``up_proj`` / ``down_proj``.
    """

    def __init__(self, r: int, num_experts: int, shapes: dict[str, tuple[int, int]]):
        super().__init__()
        self.r, self.num_experts = r, num_experts
        (inter, hidden), (up, _) = shapes["gate_proj"], shapes["up_proj"]
        self.intermediate = inter
        self.gate_up_proj = _LoRAPair(r * num_experts, hidden, inter + up)
        self.down_proj = _LoRAPair(r * num_experts, *reversed(shapes["down_proj"]))

    def _expert(self, pair: _LoRAPair, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = pair.lora_A.view(self.num_experts, self.r, pair.lora_A.shape[1])[e]
        b = pair.lora_B.view(pair.lora_B.shape[0], self.r, self.num_experts)[..., e]
        return a, b

    def expert_pairs(self) -> list[dict[str, ExpertLoRAView]]:
        """Per expert {``gate_proj``, ``up_proj``, ``down_proj``: A, B}, vLLM's split of the 3-D
        tensors, as views: gradients through them reach the fused parameters."""
        out = []
        for e in range(self.num_experts):
            a, b = self._expert(self.gate_up_proj, e)
            down = ExpertLoRAView(*self._expert(self.down_proj, e))
            out.append(dict(gate_proj=ExpertLoRAView(a, b[: self.intermediate]),
                            up_proj=ExpertLoRAView(a, b[self.intermediate :]), down_proj=down))
        return out

    def named_matrices(self, layer: int):
        """(PEFT name, parameter) of the four tensors of decoder layer ``layer``."""
        for parameter, module in FUSED_EXPERT_MODULES.items():
            pair = getattr(self, parameter)
            yield f"base_model.model.model.layers.{layer}.{module}.lora_A.weight", pair.lora_A
            yield f"base_model.model.model.layers.{layer}.{module}.lora_B.weight", pair.lora_B


def build_fused_expert_adapter(adapter_dir: str | os.PathLike, model_dir: str | os.PathLike, r: int = 8,
                               lora_alpha: float = 16, attention=("q_proj", "k_proj", "v_proj", "o_proj"),
                               seed: int = 0, std: float = 0.05) -> Path:
    """Write a random 3-D expert adapter for the MoE checkpoint in ``model_dir`` with PEFT itself
    (``target_parameters`` on the fused experts, ``attention`` as ``target_modules``), A and B
    both non-zero (PEFT's own init has B = 0, no update): what a PEFT user on transformers 5 writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(attention),
                        target_parameters=[f"mlp.experts.{p}" for p in FUSED_EXPERT_MODULES])
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(adapter_dir))
    return Path(adapter_dir)
