"""Thin adapters that expose :mod:`zero_mismatch_plugin.formulas` to verl.

verl discovers this package through the ``verl.plugins`` entry point
(:mod:`zero_mismatch_plugin.verl_adapter.register`), which registers the names below.
"""

ADVANTAGE_ESTIMATORS = ("reinforce_zero", "flash_reinforce")
POLICY_LOSSES = ("reinforce_zero", "flash_reinforce")
PLUGIN_POLICY_LOSS_CONFIG = "zero_mismatch_plugin.verl_adapter.config.ZeroMismatchPolicyLossConfig"
