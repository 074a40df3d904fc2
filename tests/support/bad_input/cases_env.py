"""Bad environment switches: a ``ZMRL_*`` switch given a value it does not take, in the process that
reads it and in the verl config that hands it to the workers, and a ``VLLM_CPU_KVCACHE_SPACE`` the
CPU engine would die on.

One parser reads every switch (``zero_mismatch_plugin.tables.switches``); each case here says what must
come of a bad value where it is read: an error naming the variable, the value and the values
allowed, before any work. Cases that need a framework process (vLLM's plugin loader, ``import
verl`` in a fresh interpreter, as every Ray worker does) run one; the rest run in-process with the
variable set for the call only.
"""

from __future__ import annotations

from support import REPO

import contextlib
import os
from pathlib import Path

from support.bad_input import CliResult, error, result, run_cli

RECIPES = str(REPO / "recipes")
DENSE = "zmrl.architecture=Qwen2ForCausalLM"
ENV = "ray_kwargs.ray_init.runtime_env.env_vars"
SWITCHES_DOC = "zero_mismatch_plugin/tables/switches.py (SWITCHES) and docs/recipes.md, 'How the switches are read'"
KV = "VLLM_CPU_KVCACHE_SPACE"
MORE_THAN_ANY_HOST = "1048576"  # GiB: 1 PiB


@contextlib.contextmanager
def environment(**values):
    """The variables set (None: removed) for the block, everything restored afterwards."""
    saved = dict(os.environ)
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def with_env(run, **values):
    def call():
        with environment(**values):
            return run()
    return call


# ----- in the process that reads the switch ------------------------------------------------------------


def fsdp_maybe_apply():
    from zero_mismatch_plugin.integrations.verl import fsdp_engine

    return fsdp_engine.maybe_apply()


def megatron_maybe_apply():
    from zero_mismatch_plugin.integrations.verl import megatron_engine

    return megatron_engine.maybe_apply()


def requested_platform():
    from zero_mismatch_plugin.integrations.verl.cpu.registration import requested_platform

    return requested_platform()


def require_vllm():
    from zero_mismatch_plugin.aligned.vllm_compat import require_vllm

    return require_vllm()


def rollout_env_vars():
    from zero_mismatch_plugin.integrations.verl.cpu.platform import PlatformCPU

    return PlatformCPU().rollout_env_vars()


def expected(name: str, value: str, first: str) -> str:
    """The parser's message: the variable, the value, then the values it takes."""
    return rf"{name}='{value}': expected '{first}' \("


def _fresh_python(code: str, **values: str) -> CliResult:
    from support import preloaded_python

    # A Python that has not imported vLLM or verl yet (support/preloaded_python.py).
    done = preloaded_python.shared().run(code, env={**os.environ, **values}, timeout=600)
    return CliResult(done.returncode, done.stdout, done.stderr)


def framework_says(text: str, exit_non_zero: bool):
    """The framework process printed ``text`` (the parser's message) on stderr, and failed when due."""
    def check(res: CliResult) -> None:
        assert text in res.err, res.err[-3000:]
        if exit_non_zero:
            assert res.code != 0, res.err[-3000:]
        else:
            assert "ERROR" in res.err or "could NOT be applied" in res.err, res.err[-3000:]
    return check


# ----- zmrl commands that start a CPU engine: refused before any work ----------------------------------

# The tiny Llama and the "nothing may start" guard are cases_cli's: one checkpoint, one list of starters.
from support.bad_input.cases_cli import _nothing_may_start, _workdir, tiny_model  # noqa: E402


def refused(argv_of, **values):
    """``zmrl argv`` with the variables set and every engine / model / training start made to fail."""
    def call():
        argv = argv_of()  # builds the tiny model, if needed, before starting anything is refused
        with environment(**values), _nothing_may_start():
            return run_cli(argv)
    return call


def check_command():
    return ["check", "--model", tiny_model(), "--quiet"]


def demo_command():
    return ["demo", "--updates", "1", "--out", str(_workdir() / "demo-out")]


def validate(*overrides: str):
    return run_cli(["validate-config", "--config-path", RECIPES, "--config-name", "reinforce_zero", DENSE, *overrides])


def validated_with(text: str):
    def check(res: CliResult) -> None:
        assert res.code == 0, res.err
        assert text in res.out + res.err, res.out + res.err
    return check


RUNTIME = [
    error("fsdp-aligned-maybe", with_env(fsdp_maybe_apply, ZMRL_FSDP_ALIGNED="maybe"),
          expected("ZMRL_FSDP_ALIGNED", "maybe", "1") + r".*or '0' \(off\)", ValueError),
    error("megatron-aligned-maybe", with_env(megatron_maybe_apply, ZMRL_MEGATRON_ALIGNED="maybe"),
          expected("ZMRL_MEGATRON_ALIGNED", "maybe", "1") + r".*or '0' \(off\)", ValueError),
    error("verl-platform-upper-case", with_env(requested_platform, ZMRL_VERL_PLATFORM="CPU"),
          expected("ZMRL_VERL_PLATFORM", "CPU", "cpu") + r".*set ZMRL_VERL_PLATFORM=cpu", ValueError),
    error("allow-unsupported-vllm-yes", with_env(require_vllm, ZMRL_ALLOW_UNSUPPORTED_VLLM="yes"),
          expected("ZMRL_ALLOW_UNSUPPORTED_VLLM", "yes", "1"), ValueError),
    error("check-numerics-garbage", refused(check_command, ZMRL_NUMERICS="garbage"),
          expected("ZMRL_NUMERICS", "garbage", "consistent") + r".*or 'fast' \("),
    # In the framework processes: vLLM calls the plugin's hook unguarded (the engine must not start);
    # verl's plugin loader logs an entry point's exception at DEBUG, so the plugin logs it at ERROR.
    result("vllm-plugin-hook-numerics-garbage",
           lambda: _fresh_python("from vllm.plugins import load_general_plugins\nload_general_plugins()\n",
                               ZMRL_NUMERICS="garbage"),
           framework_says("ZMRL_NUMERICS='garbage': expected 'consistent' (", exit_non_zero=True), SWITCHES_DOC),
    result("verl-worker-import-fsdp-aligned-maybe",
           lambda: _fresh_python("import verl\n", ZMRL_FSDP_ALIGNED="maybe"),
           framework_says("ZMRL_FSDP_ALIGNED='maybe': expected '1' (", exit_non_zero=False), SWITCHES_DOC),
]

KV_CACHE = [
    error(f"cpu-rollout-kv-cache-{name}", with_env(rollout_env_vars, VLLM_CPU_KVCACHE_SPACE=value),
          rf"{KV}='{value}': expected a whole number of GiB from 1 to \d+ \(the memory available now\)", ValueError)
    for name, value in (("zero", "0"), ("negative", "-4"), ("not-a-number", "lots"), ("fraction", "1.5"),
                        ("more-than-available", MORE_THAN_ANY_HOST))
] + [
    error("check-kv-cache-zero", refused(check_command, VLLM_CPU_KVCACHE_SPACE="0"),
          rf"{KV}='0': expected a whole number of GiB from 1 to \d+"),
    error("check-kv-cache-not-a-number", refused(check_command, VLLM_CPU_KVCACHE_SPACE="abc"),
          rf"{KV}='abc': expected a whole number of GiB"),
    error("demo-kv-cache-more-than-available", refused(demo_command, VLLM_CPU_KVCACHE_SPACE=MORE_THAN_ANY_HOST),
          rf"{KV}='{MORE_THAN_ANY_HOST}': expected a whole number of GiB from 1 to \d+ .*larger than the available memory"),
]

# ----- in the verl config: validate-config / recipes run read the switches as the workers will ----------

IN_CONFIG = [
    error("config-fsdp-switch-maybe-with-a-megatron-actor", lambda: validate(f"++{ENV}.ZMRL_FSDP_ALIGNED='maybe'"),
          rf"{ENV}.ZMRL_FSDP_ALIGNED: is 'maybe', but must be '1' \("),
    error("config-prefix-caching-switch-yes", lambda: validate(f"++{ENV}.ZMRL_ALLOW_PREFIX_CACHING='yes'"),
          rf"{ENV}.ZMRL_ALLOW_PREFIX_CACHING: is 'yes', but must be '1' \("),
    error("config-verl-platform-tpu", lambda: validate(f"++{ENV}.ZMRL_VERL_PLATFORM='tpu'"),
          rf"{ENV}.ZMRL_VERL_PLATFORM: is 'tpu', but must be 'cpu' \("),
    error("config-misspelt-switch-name", lambda: validate(f"++{ENV}.ZMRL_NUMERIC=consistent"),
          rf"{ENV}.ZMRL_NUMERIC: is not a switch of the plugin, so nothing reads it: did you mean ZMRL_NUMERICS\?"),
    error("config-two-bad-switches-both-named",
          lambda: validate(f"++{ENV}.ZMRL_FSDP_ALIGNED='true'", f"++{ENV}.ZMRL_ALLOW_UNSUPPORTED_VLLM='on'"),
          rf"(?s)ZMRL_FSDP_ALIGNED: is 'true'.*ZMRL_ALLOW_UNSUPPORTED_VLLM: is 'on'"),
    # Empty is unset, as in the worker processes: no consistent numerics, so the aligned switch is only a warning.
    result("config-numerics-switch-empty-is-unset", lambda: validate(f"{ENV}.ZMRL_NUMERICS=''"),
           validated_with("the aligned trainer forward is on without ZMRL_NUMERICS=consistent"), SWITCHES_DOC),
]

CASES = RUNTIME + KV_CACHE + IN_CONFIG
