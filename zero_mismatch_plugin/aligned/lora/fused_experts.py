"""PEFT's 3-D expert adapters (``target_parameters``): LoRA on transformers 5's fused expert parameters.

The trainer keeps PEFT's tensors per MoE layer as its parameters (:class:`FusedExpertLoRA`) and
hands :class:`~zero_mismatch_plugin.aligned.moe.AlignedMoELoRA` vLLM's per-expert split of them as
views, so its forward is the engine's and the adapter is written back in the 3-D format. The
format and how vLLM serves it: ``docs/lora.md`` ("3-D expert adapters").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zero_mismatch_plugin.aligned.lora.names import FUSED_EXPERT_MODULES
from zero_mismatch_plugin.aligned.lora.targets import LoRAPair


def check_engine_serves_fused_experts(runtime) -> None:
    """Refuse engine arguments under which vLLM cannot serve a 3-D expert adapter."""
    lora = runtime.vllm_config.lora_config
    if lora is None or not lora.enable_mixed_moe_lora_format:
        raise ValueError(
            "a 3-D expert adapter (target_parameters) needs enable_mixed_moe_lora_format=True in the engine's "
            "(and the trainer's) arguments, as lora_engine_args gives them, and requests with "
            "is_3d_lora_weight=True (lora.peft.lora_request)"
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
        self.gate_up_proj = LoRAPair(r * num_experts, hidden, inter + up)
        self.down_proj = LoRAPair(r * num_experts, *reversed(shapes["down_proj"]))

    def _expert(self, pair: LoRAPair, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Expert e's A_e = A.view(E, r, in)[e] and B_e = B.view(out, r, E)[..., e], as PEFT splits them.
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
