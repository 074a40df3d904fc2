"""Reading the checkpoint the engine serves into a trainer's parameters (both faces)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def read_config(model_dir: str | os.PathLike, **kwargs):
    """The checkpoint's config as transformers reads it (``AutoConfig``, ``kwargs`` passed on), or,
    for a model type transformers does not define and vLLM does (Kimi Linear's ``kimi_linear``),
    as vLLM reads it; vLLM then registers that config class with ``AutoConfig``, as its engine does."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), **kwargs)
    except ValueError as error:
        if "does not recognize this architecture" not in str(error):
            raise
        from vllm.transformers_utils.config import get_config

        try:
            return get_config(str(model_dir), trust_remote_code=bool(kwargs.get("trust_remote_code", False)))
        except Exception:  # noqa: BLE001 - vLLM does not define it either: transformers' message says why
            raise error from None


def read_checkpoint(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, under its names."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def copy_checkpoint(params: dict, state: dict[str, torch.Tensor], ignored=()) -> None:
    """Copy ``state`` into ``params`` by name, in each parameter's dtype; refuses a missing, an
    unexpected (unless its name contains one of ``ignored``) or a misshapen tensor."""
    missing = sorted(set(params) - set(state))
    unexpected = sorted(k for k in set(state) - set(params) if not any(part in k for part in ignored))
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in params.items():
            src = state[name]
            if src.shape != p.shape:
                raise ValueError(f"{name}: checkpoint {tuple(src.shape)} vs model {tuple(p.shape)}")
            p.copy_(src.to(p.dtype))
