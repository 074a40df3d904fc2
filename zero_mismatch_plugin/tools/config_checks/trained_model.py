"""What a verl config trains: the model's architecture (from its local ``config.json`` or
``zmrl.architecture``) and whether verl's FSDP engine switch, not the Megatron one, judges it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from zero_mismatch_plugin.tables import architectures
from zero_mismatch_plugin.integrations.verl.fsdp_engine import ENABLE_ENV as FSDP_ENABLE_ENV

from zero_mismatch_plugin.tools.config_checks.cluster import uses_megatron
from zero_mismatch_plugin.tools.config_checks.numerics import env_switch
from zero_mismatch_plugin.tools.config_checks.values import ConfigValueError, read

ARCHITECTURE_KEY = "zmrl.architecture"


@dataclass(frozen=True)
class Architecture:
    name: str | None
    source: str
    features: dict = field(default_factory=dict)  # megatron-style feature flags read from config.json


def _model_dir(cfg: DictConfig) -> tuple[str, Path]:
    key = "actor_rollout_ref.model.hf_config_path"
    path = read(cfg, key)
    if path is None:
        key = "actor_rollout_ref.model.path"
        path = read(cfg, key)
    return key, Path(path).expanduser()


def _features(hf_config: dict) -> dict:
    """The config.json fields the aligned spec's feature check knows, under megatron's names."""
    experts = next((hf_config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if hf_config.get(k)), None)
    # Qwen2 configs carry a window with use_sliding_window=false; Mistral's has no switch: a window is on.
    sliding = hf_config.get("sliding_window") if hf_config.get("use_sliding_window", True) else None
    name = (hf_config.get("architectures") or [None])[0]
    if isinstance(sliding, int) and architectures.windows_covered(name, hf_config.get("layer_types")):
        sliding = (sliding - 1, 0)  # megatron-core's causal window for vLLM's window
    return {"num_moe_experts": experts, "multi_latent_attention": bool(hf_config.get("kv_lora_rank")),
            "window_size": sliding}


def model_architecture(cfg: DictConfig) -> Architecture:
    """From the local ``config.json`` of the model when there is one, else the recipe's ``zmrl.architecture``."""
    key, directory = _model_dir(cfg)
    config_file = directory / "config.json"
    if config_file.is_file():
        try:
            hf_config = json.loads(config_file.read_text(encoding="utf-8"))
            name = (hf_config.get("architectures") or [None])[0]
        except (OSError, ValueError, AttributeError, TypeError) as error:
            raise ConfigValueError(key, f"{config_file} is not a readable model config ({error}): "
                                        "point the key at a checkpoint directory") from None
        if not isinstance(name, str):
            raise ConfigValueError(key, f"{config_file} names no architecture (its \"architectures\" list is "
                                        "missing or empty)")
        return Architecture(name, str(config_file), _features(hf_config))
    declared = read(cfg, ARCHITECTURE_KEY)
    if declared is not None:
        return Architecture(declared, ARCHITECTURE_KEY)
    return Architecture(None, f"{key} {str(directory)!r} has no local config.json and {ARCHITECTURE_KEY} is not set")


def uses_fsdp_switch(cfg: DictConfig) -> bool:
    """An FSDP actor whose config sets the FSDP engine's aligned switch."""
    return not uses_megatron(cfg) and env_switch(cfg, FSDP_ENABLE_ENV) is not None
