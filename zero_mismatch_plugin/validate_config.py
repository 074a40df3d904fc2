"""``zmrl validate-config``: compose a verl config as verl would and check it, reporting every
problem at once with the key to change.

Hydra is only used to compose the config (:func:`compose_verl_config`), exactly as
``python -m verl.trainer.main_ppo --config-path DIR --config-name NAME overrides...`` would; the
checks themselves live in :mod:`zero_mismatch_plugin.config_checks`, shared with ``zmrl recipes run``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig

from zero_mismatch_plugin.config_checks import Problem, checked, format_report
from zero_mismatch_plugin.config_checks.algorithms import FLASH_REINFORCE, REINFORCE_ZERO

__all__ = ["FLASH_REINFORCE", "REINFORCE_ZERO", "Problem", "compose_verl_config", "format_report", "validate_config"]


def compose_verl_config(config_path: str | Path, config_name: str, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose ``config_name`` from ``config_path`` with Hydra overrides, as verl's launcher does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = Path(config_path).expanduser().resolve()
    if not config_dir.is_dir():
        raise FileNotFoundError(f"--config-path {config_path}: no such directory")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def validate_config(cfg: DictConfig) -> list[Problem]:
    """Every bad value, and every requirement of reinforce_zero / flash_reinforce (estimator, loss,
    sampling) that ``cfg`` violates. ``zmrl validate-config`` adds the cluster and alignment checks
    (:func:`zero_mismatch_plugin.config_checks.check_config`)."""
    from zero_mismatch_plugin.config_checks import algorithm_checks

    return checked(cfg, *algorithm_checks())
