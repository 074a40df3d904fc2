"""The one place a composed verl config is checked, for ``zmrl validate-config`` and ``zmrl recipes run``.

:func:`check_config` reads every value through :mod:`.values` and reports every bad one at once;
only then do the checks that compute with the values run (:mod:`.algorithms`, :mod:`.numerics`,
:mod:`.cluster`, :mod:`.lora`, :mod:`.alignment`). See docs/recipes.md, "What the checks cover".
"""

from __future__ import annotations

from typing import Callable

from omegaconf import DictConfig

from zero_mismatch_plugin.tools.config_checks.problems import Problem, format_report
from zero_mismatch_plugin.tools.config_checks.values import ConfigValueError, value_errors

Check = Callable[[DictConfig], list[Problem]]


def checked(cfg: DictConfig, *checks: Check) -> list[Problem]:
    """Every bad value at once; when all values read cleanly, the problems ``checks`` find."""
    problems = [Problem(error.key, error.reason) for error in value_errors(cfg)]
    if problems:
        return problems
    for check in checks:
        try:
            problems += check(cfg)
        except ConfigValueError as error:  # a required key that is absent
            problems.append(Problem(error.key, error.reason))
    return problems


def algorithm_checks() -> tuple[Check, ...]:
    from zero_mismatch_plugin.tools.config_checks.algorithms import algorithm_problems
    from zero_mismatch_plugin.tools.config_checks.numerics import sampling_problems

    return algorithm_problems, sampling_problems


def run_checks() -> tuple[Check, ...]:
    from zero_mismatch_plugin.tools.config_checks.alignment import alignment_problems
    from zero_mismatch_plugin.tools.config_checks.cluster import cluster_problems
    from zero_mismatch_plugin.tools.config_checks.lora import lora_problems
    from zero_mismatch_plugin.tools.config_checks.numerics import numerics_problems

    return cluster_problems, numerics_problems, lora_problems, alignment_problems


def check_config(cfg: DictConfig) -> list[Problem]:
    """Everything: what the algorithms need, what verl would reject on the cluster, what parity needs."""
    return checked(cfg, *algorithm_checks(), *run_checks())


__all__ = ["ConfigValueError", "Problem", "check_config", "checked", "format_report"]
