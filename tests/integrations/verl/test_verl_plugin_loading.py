"""verl must find the plugin through its entry point, in an interpreter that has not imported verl
yet (a child of support/preloaded_python.py), and a failure to register must be loud."""

import os
import subprocess

from support import preloaded_python

PROBE = (
    "import sys, verl\n"
    "from verl.trainer.ppo import core_algos\n"
    "names = ('reinforce_zero', 'flash_reinforce')\n"
    "print(all(n in core_algos.ADV_ESTIMATOR_REGISTRY for n in names),"
    " all(n in core_algos.POLICY_LOSS_REGISTRY for n in names))\n"
)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return preloaded_python.shared().run(code, env={**os.environ, **env}, timeout=240)


def test_import_verl_registers_estimators_and_losses_through_the_entry_point():
    assert _run(PROBE).stdout.split() == ["True", "True"]


def test_without_entry_points_nothing_is_registered():
    # Negative control: the names above come from the entry point, not from an import in the probe.
    assert _run(PROBE, VERL_USE_EXTERNAL_PLUGINS="none").stdout.split() == ["False", "False"]


def test_registration_failure_is_reported_at_warning_level():
    code = (
        "from verl.trainer.ppo import core_algos\n"
        "core_algos.register_policy_loss('reinforce_zero')(lambda **kw: None)\n"
        "try:\n"
        "    import zero_mismatch_plugin.integrations.verl.register\n"
        "except RuntimeError:\n"
        "    print('raised')\n"
    )
    result = _run(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert "raised" in result.stdout
    assert "zero_mismatch_plugin FAILED to register" in result.stderr
    assert "already has a policy loss named 'reinforce_zero'" in result.stderr


def test_registering_twice_is_a_no_op():
    from verl.trainer.ppo import core_algos

    from zero_mismatch_plugin.integrations.verl.register import register

    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    register()
    register()
    assert core_algos.POLICY_LOSS_REGISTRY == before


def test_selfcheck_passes_with_two_computations_and_a_metric_that_tells_one_ulp(capsys):
    from zero_mismatch_plugin.tools.cli import main

    assert main(["selfcheck"]) == 0
    out = capsys.readouterr().out
    assert "selfcheck passed" in out
    row = next(line for line in out.splitlines() if line.startswith("bitwise-equal fraction (one token 1 ulp off)"))
    # 24 of 25 tokens equal, for both losses (fp32 mean of 24 ones and a zero).
    assert [abs(float(v) - 24 / 25) < 1e-6 for v in row.split()[-2:]] == [True, True]


def test_selfcheck_fails_a_bitwise_metric_blind_to_one_ulp():
    from zero_mismatch_plugin.tools.selfcheck import ALGORITHMS, selfcheck_failures

    good = {"advantage_row0": 0.5, "rollout_corr/rollout_is_mean": 1.0, "zero_mismatch/bitwise_equal_fraction": 1.0,
            "bitwise_one_ulp_off": 24 / 25, "rollout_corr/k3_kl": 0.0, "grad_finite": True}
    report = {"reinforce_zero": good, "flash_reinforce": {**good, "advantage_row0": 0.4}}
    assert selfcheck_failures(report) == []
    # A metric that reports 1 whatever the bits (e.g. comparing a tensor with its own copy).
    blind = {name: {**report[name], "bitwise_one_ulp_off": 1.0} for name in ALGORITHMS}
    failures = selfcheck_failures(blind)
    assert len(failures) == 2 and all("1 ulp off" in f for f in failures)
