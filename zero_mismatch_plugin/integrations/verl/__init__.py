"""Thin adapters that expose :mod:`zero_mismatch_plugin.algorithms.formulas` to verl.

verl discovers this package through the ``verl.plugins`` entry point
(:mod:`zero_mismatch_plugin.integrations.verl.register`), which registers the names below.
"""

ADVANTAGE_ESTIMATORS = ("reinforce_zero", "flash_reinforce")
POLICY_LOSSES = ("reinforce_zero", "flash_reinforce")
PLUGIN_POLICY_LOSS_CONFIG = "zero_mismatch_plugin.integrations.verl.config.ZeroMismatchPolicyLossConfig"

# Module attribute set by verl patch 0003 (patches/verl/): its ppo_loss passes the rollout's
# logprobs mu to losses that take ``rollout_log_probs``, so bypass mode is no longer needed.
ROLLOUT_LOG_PROBS_MARKER = "POLICY_LOSS_RECEIVES_ROLLOUT_LOG_PROBS"


def verl_passes_rollout_log_probs() -> bool:
    """Whether the installed verl's ``ppo_loss`` hands mu to the policy loss as its own input."""
    try:
        from verl.workers.utils import losses
    except ImportError:
        return False
    return bool(getattr(losses, ROLLOUT_LOG_PROBS_MARKER, False))
