"""Per-update diagnostics of the rollout-to-learner gap, framework-free.

Names follow verl's ``rollout_corr/*`` metrics wherever the meaning is identical, so a
run that uses this plugin and one that uses verl's own rollout correction can be read
with the same dashboards (see docs/algorithms.md, "Metrics").
"""

from __future__ import annotations

import torch

from zero_mismatch_plugin.formulas import (
    MAX_LOG_IMPORTANCE_RATIO,
    effective_sample_size_fraction,
    k3_divergence,
    token_log_importance_ratio,
)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def importance_sampling_metrics(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                                response_mask: torch.Tensor) -> dict[str, float]:
    """Token-level statistics of w = pi/mu over the response tokens.

    ``rollout_corr/*`` keys mean exactly what verl's rollout-correction metrics mean
    (verl computes them in decoupled mode; in bypass mode with this plugin's losses they
    come from here). ``zero_mismatch/*`` keys are this plugin's own.
    """
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    log_prob = log_prob.detach().float()
    behaviour_log_prob = behaviour_log_prob.detach().float()
    log_ratio = token_log_importance_ratio(log_prob, behaviour_log_prob)
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_IMPORTANCE_RATIO))
    selected_ratio = ratio[mask]
    selected_log_ratio = log_ratio[mask]
    return {
        "rollout_corr/rollout_is_mean": selected_ratio.mean().item(),
        "rollout_corr/rollout_is_min": selected_ratio.min().item(),
        "rollout_corr/rollout_is_max": selected_ratio.max().item(),
        "rollout_corr/rollout_is_eff_sample_size": effective_sample_size_fraction(ratio, mask).item(),
        # k1 estimator of KL(mu || pi): E_mu[log mu - log pi]  (verl: rollout_corr/kl)
        "rollout_corr/kl": (-selected_log_ratio).mean().item(),
        # k3 = w - 1 - log w: the REINFORCE Zero paper's per-token D3  (verl: rollout_corr/k3_kl)
        "rollout_corr/k3_kl": _masked_mean(k3_divergence(log_ratio.clamp(max=MAX_LOG_IMPORTANCE_RATIO)), mask).item(),
        # Kernel mismatch shows up here first: at lag 0 with aligned kernels this is 1.0.
        "zero_mismatch/bitwise_equal_fraction": (log_prob[mask] == behaviour_log_prob[mask]).float().mean().item(),
        "zero_mismatch/log_prob_abs_diff_max": selected_log_ratio.abs().max().item(),
        "zero_mismatch/is_log_ratio_capped_fraction": (selected_log_ratio > MAX_LOG_IMPORTANCE_RATIO).float().mean().item(),
    }
