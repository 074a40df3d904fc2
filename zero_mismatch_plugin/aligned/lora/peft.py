"""PEFT adapter directories: the config the aligned path reads, what it refuses, reading and writing.

An adapter is PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), the format
``vllm.lora.request.LoRARequest`` loads; vLLM's ``PEFTHelper`` reads the config and computes the
scaling. What is refused and why: ``docs/lora.md``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zero_mismatch_plugin.aligned.lora.names import ALIGNED_LORA_TARGETS, EXPERT_TARGETS, FUSED_EXPERT_MODULES
from zero_mismatch_plugin.tables.architectures import REFUSED_LORA_TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def lora_scaling(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The factor the low-rank update BA is multiplied by: ``alpha / r`` (LoRA, Hu et al. 2021),
    or ``alpha / sqrt(r)`` (rsLoRA, Kalajdzievski 2023). vLLM folds it into B at load."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


@dataclass(frozen=True)
class LoRAConfig:
    """What the aligned path reads from a PEFT ``adapter_config.json``."""

    r: int
    lora_alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    # PEFT's ``target_parameters``: the routed experts' 3-D gate_up_proj / down_proj (:mod:`.fused_experts`).
    target_parameters: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return lora_scaling(self.lora_alpha, self.r, self.use_rslora)

    def as_peft_dict(self) -> dict:
        return dict(
            peft_type="LORA",
            task_type="CAUSAL_LM",
            r=self.r,
            lora_alpha=self.lora_alpha,
            target_modules=list(self.targets),
            target_parameters=list(self.target_parameters) or None,
            use_rslora=self.use_rslora,
            use_dora=False,
            bias="none",
            modules_to_save=None,
            lora_dropout=0.0,
            fan_in_fan_out=False,
        )


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


def unsupported_lora_settings(config: dict, supported: tuple[str, ...] = ALIGNED_LORA_TARGETS) -> list[str]:
    """Every setting of a PEFT adapter config the aligned LoRA path does not run, with the change
    that fixes it; ``supported``: the model's targets (:func:`~.names.supported_lora_targets`)."""
    out = unsupported_target_parameters(config)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        out.append(f"peft_type={peft_type!r}: only LORA adapters")
    if config.get("use_dora"):
        out.append("use_dora=true (DoRA): vLLM does not serve DoRA; train a plain LoRA (use_dora=false)")
    if config.get("bias", "none") != "none":
        out.append(f"bias={config['bias']!r}: adapter biases are not served by vLLM; set bias='none'")
    if config.get("modules_to_save"):
        out.append(
            f"modules_to_save={config['modules_to_save']}: fully trained modules are not served by "
            "vLLM for a causal LM; set modules_to_save=null"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            out.append(f"{key}={config[key]}: per-module ranks/alphas are not supported; remove {key}")
    if config.get("fan_in_fan_out"):
        out.append("fan_in_fan_out=true: only nn.Linear-layout adapters; set fan_in_fan_out=false")
    for key in ("layers_to_transform", "layers_pattern"):
        if config.get(key) not in (None, [], ""):
            out.append(f"{key}={config[key]!r}: adapters on a subset of layers are not supported; remove {key}")
    if config.get("use_qalora") or config.get("lora_bias"):
        out.append("lora_bias / QA-LoRA: not supported; train a plain LoRA")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets in supported else None
        if targets is None:
            out.append(
                f"target_modules={config['target_modules']!r}: give the target modules as a list "
                f"of names from {list(supported)}"
            )
    if isinstance(targets, (list, tuple)):
        refused = [t for t in targets if t in REFUSED_LORA_TARGETS and t not in supported]
        out.extend(f"target_modules {t!r}: {REFUSED_LORA_TARGETS[t]}; remove it" for t in refused)
        bad = [t for t in targets if t not in supported and t not in refused]
        if bad:
            out.append(
                f"target_modules {bad}: the aligned LoRA path covers {list(supported)} "
                "(the MoE router is not aligned)"
            )
        if not targets and not config.get("target_parameters"):
            out.append("target_modules is empty")
    elif targets is None and not out and not config.get("target_parameters"):
        out.append("target_modules is missing")
    r = config.get("r")
    if not isinstance(r, int) or r <= 0:
        out.append(f"r={r!r}: the rank must be a positive integer")
    return out


def malformed_lora_settings(config) -> list[str]:
    """What in an ``adapter_config.json`` (as read from JSON) is not what PEFT writes, one
    sentence each: not an object, a ``lora_alpha`` that is not a finite number, ``target_modules``
    that are not module names, a NaN or an infinity anywhere. Empty when it can be read."""
    if not isinstance(config, dict):
        return [f"not a JSON object (it holds a {type(config).__name__}): PEFT writes one object of settings"]
    out = []
    bad_numbers = sorted(k for k, v in config.items() if isinstance(v, float) and not math.isfinite(v))
    out.extend(f"{k}={config[k]!r}: give a finite number" for k in bad_numbers)
    alpha = config.get("lora_alpha")
    if "lora_alpha" not in config:
        out.append("lora_alpha is missing: give the adapter's alpha (a number)")
    elif "lora_alpha" not in bad_numbers and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        out.append(f"lora_alpha={alpha!r}: must be a number (PEFT writes e.g. 16), not a {type(alpha).__name__}")
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        out.append(f"target_modules={targets!r}: give module names, a list of strings")
    for key in ("use_rslora", "use_dora"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            out.append(f"{key}={config[key]!r}: must be true or false")
    return out


def read_lora_config(adapter_dir: str | os.PathLike, supported: tuple[str, ...] = ALIGNED_LORA_TARGETS) -> LoRAConfig:
    """Read and check ``adapter_config.json`` with vLLM's ``PEFTHelper``; refuse what the aligned
    path does not run for a model adapting ``supported``, naming each setting; a file that is not
    a readable adapter config (:func:`malformed_lora_settings`) is a ``ValueError`` naming it."""
    from vllm.lora.peft_helper import PEFTHelper

    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: a PEFT adapter directory needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON file ({error})") from None
    malformed = malformed_lora_settings(raw)
    if malformed:
        raise ValueError(f"{path}: " + "; ".join(malformed))
    problems = unsupported_lora_settings(raw, supported)
    if problems:
        raise NotImplementedError(f"{adapter_dir}: LoRA adapter not supported: " + "; ".join(problems))
    helper = PEFTHelper.from_dict({**raw, "vllm_max_position_embeddings": None})
    targets = raw.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    parameters = raw.get("target_parameters") or ()
    config = LoRAConfig(
        r=helper.r, lora_alpha=helper.lora_alpha, targets=targets, use_rslora=bool(helper.use_rslora),
        target_parameters=(parameters,) if isinstance(parameters, str) else tuple(parameters),
    )
    if config.scaling != helper.vllm_lora_scaling_factor:
        raise AssertionError(
            f"scaling {config.scaling} differs from vLLM's {helper.vllm_lora_scaling_factor}"
        )
    return config


def write_peft_adapter(adapter_dir: str | os.PathLike, lora_config: LoRAConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` (PEFT names) and ``lora_config`` in PEFT's format, what ``LoRARequest``
    loads; return the directory."""
    from safetensors.torch import save_file

    out = Path(adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(lora_config.as_peft_dict(), indent=1))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    return out


# ----- serving an adapter --------------------------------------------------------------------


def lora_engine_args(adapter_dir: str | os.PathLike, max_loras: int = 2) -> dict:
    """Engine arguments serving the adapter in ``adapter_dir`` (engine and trainer both take them).

    ``max_lora_rank``: the smallest rank vLLM accepts that holds the adapter; ``max_loras`` 2: the
    adapter's current and next version can be served side by side during a sync;
    ``enable_mixed_moe_lora_format`` for a 3-D expert adapter (:mod:`.fused_experts`).
    """
    try:
        return lora_engine_args_for_config(read_lora_config(adapter_dir), max_loras)
    except NotImplementedError as error:
        raise NotImplementedError(f"{adapter_dir}: {error}") from None


def lora_engine_args_for_config(config: LoRAConfig, max_loras: int = 2) -> dict:
    """Engine arguments serving an adapter of this config (see :func:`lora_engine_args`)."""
    args = lora_engine_args_for_rank(config.r, max_loras)
    if config.target_parameters:
        args["enable_mixed_moe_lora_format"] = True
    return args


def lora_engine_args_for_rank(r: int, max_loras: int = 2) -> dict:
    """Engine arguments serving adapters of rank ``r`` (see :func:`lora_engine_args`)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(get_args(MaxLoRARanks))
    if r > ranks[-1]:
        raise NotImplementedError(f"rank {r} exceeds vLLM's largest max_lora_rank {ranks[-1]}")
    return dict(enable_lora=True, max_lora_rank=min(x for x in ranks if x >= r), max_loras=max_loras)


def is_fused_expert_adapter(adapter_dir: str | os.PathLike) -> bool:
    """Whether the PEFT adapter in ``adapter_dir`` has 3-D expert tensors (``target_parameters``)."""
    return bool(json.loads((Path(adapter_dir) / CONFIG_FILE).read_text()).get("target_parameters"))


def lora_request(lora_name: str, lora_int_id: int, adapter_dir: str | os.PathLike, **kwargs):
    """vLLM's ``LoRARequest`` for the adapter in ``adapter_dir``, ``is_3d_lora_weight`` set as its
    format needs (a 3-D expert adapter is otherwise read as 2-D and the engine fails)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name, lora_int_id, str(adapter_dir),
                       is_3d_lora_weight=is_fused_expert_adapter(adapter_dir), **kwargs)
