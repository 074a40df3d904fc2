"""The plugin's policy-loss settings, as a subclass of verl's ``PolicyLossConfig``.

verl builds the actor's ``policy_loss`` dataclass from its ``_target_``; pointing that at
this class (``actor_rollout_ref.actor.policy_loss._target_=`` the path below) makes the
extra fields valid keys, and importing the target imports the plugin in every worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

KL_DIRECTIONS = ("behaviour_to_learner", "learner_to_behaviour")

# The FlashREINFORCE write-up gives no value for delta. 0.01 nats of mean per-token
# Bernoulli KL admits ordinary lag (most tokens sit near p = 1, where the proxy is ~0)
# and rejects a trajectory whose sampled actions moved by several percent on average.
DEFAULT_TRUST_REGION_DELTA = 0.01


@dataclass
class ZeroMismatchPolicyLossConfig(PolicyLossConfig):
    """Adds FlashREINFORCE's trust-region knobs to verl's policy-loss config.

    Args:
        trust_region_delta: admit trajectory i iff its mean per-token Bernoulli KL <= delta.
        kl_direction: ``behaviour_to_learner`` = KL(Bern(mu) || Bern(pi)) (default) or
            ``learner_to_behaviour`` = KL(Bern(pi) || Bern(mu)).
    """

    trust_region_delta: float = DEFAULT_TRUST_REGION_DELTA
    kl_direction: str = "behaviour_to_learner"

    def __post_init__(self):
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        if not (isinstance(self.trust_region_delta, int | float) and self.trust_region_delta > 0):
            raise ValueError(
                "actor_rollout_ref.actor.policy_loss.trust_region_delta must be a positive number, "
                f"got {self.trust_region_delta!r}"
            )
        if self.kl_direction not in KL_DIRECTIONS:
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.kl_direction must be one of {KL_DIRECTIONS}, "
                f"got {self.kl_direction!r}"
            )
