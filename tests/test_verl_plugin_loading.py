"""verl must find the plugin through its entry point, in a fresh interpreter, and a
failure to register must be loud."""

import os
import subprocess
import sys

PROBE = (
    "import sys, verl\n"
    "from verl.trainer.ppo import core_algos\n"
    "names = ('reinforce_zero', 'flash_reinforce')\n"
    "print(all(n in core_algos.ADV_ESTIMATOR_REGISTRY for n in names),"
    " all(n in core_algos.POLICY_LOSS_REGISTRY for n in names))\n"
)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env})


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
        "    import zero_mismatch_plugin.verl_adapter.register\n"
        "except RuntimeError:\n"
        "    print('raised')\n"
    )
    result = _run(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert "raised" in result.stdout
    assert "zero_mismatch_plugin FAILED to register" in result.stderr
    assert "already has a policy loss named 'reinforce_zero'" in result.stderr


def test_registering_twice_is_a_no_op():
    from verl.trainer.ppo import core_algos

    from zero_mismatch_plugin.verl_adapter.register import register

    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    register()
    register()
    assert core_algos.POLICY_LOSS_REGISTRY == before
