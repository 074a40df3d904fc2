"""The standard-kernel baselines' rollout correction, read from the shipped ablation recipes.

The paper's "IS", "IS + sequence gate" and "IS + token gate" rows are verl's own
rollout-correction options (``algorithm.rollout_correction``: bypass mode, REINFORCE loss with
token IS weights, optional rejection). The recipes' ``zm_algorithm`` group holds those settings
once; the demo composes the same files, so a baseline here is the recipe's baseline.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

# The demo's name for each baseline -> its zm_algorithm file.
CORRECTIONS = {
    "is": "reinforce_is_standard",
    "is_sequence_gate": "reinforce_is_sequence_gate",
    "is_token_gate": "reinforce_is_token_gate",
}


def _group_dir() -> Path:
    import zero_mismatch_plugin.tools.recipes as recipes

    return Path(recipes.__file__).parent / "zm_algorithm"


def _compose(name: str) -> dict:
    """A zm_algorithm file with its ``defaults`` (same group) merged under it, as Hydra does."""
    config = OmegaConf.load(_group_dir() / f"{name}.yaml")
    defaults = config.pop("defaults", [])
    merged = OmegaConf.create({})
    for entry in defaults:
        if entry != "_self_":
            merged = OmegaConf.merge(merged, _compose(entry))
    return OmegaConf.to_container(OmegaConf.merge(merged, config), resolve=False)


def rollout_correction_settings(correction: str) -> tuple[dict, dict]:
    """(``algorithm`` block, ``rollout_correction`` block) of the recipe behind ``correction``."""
    if correction not in CORRECTIONS:
        raise ValueError(f"rollout correction must be one of {tuple(CORRECTIONS)}, got {correction!r}")
    algorithm = _compose(CORRECTIONS[correction])["algorithm"]
    return algorithm, dict(algorithm["rollout_correction"])
