"""Per-update diagnostics of the rollout-to-learner gap, framework-free.

Names follow verl's ``rollout_corr/*`` metrics wherever the meaning is identical (docs/algorithms.md,
"Metrics"). Masked positions are never read; the two logprobs and the mask must have one shape
(``ValueError`` naming the input).
"""

from __future__ import annotations

import torch

from zero_mismatch_plugin.algorithms.formulas import (
    MAX_LOG_IMPORTANCE_RATIO,
    check_shapes,
    compute_dtype,
    effective_sample_size_fraction,
    k3_divergence,
    log_ratio_cap,
    masked,
    token_log_importance_ratio,
)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked(values, mask).sum() / mask.to(values.dtype).sum().clamp(min=1)


def _in_compute_dtype(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Detached copies in float32 (or float64 when an input is): 16-bit inputs are
    compared and exponentiated in fp32, float64 inputs keep their bits."""
    dtype = compute_dtype(*(tensor.dtype for tensor in tensors))
    return [tensor.detach().to(dtype) for tensor in tensors]


def _gap_statistics(log_prob: torch.Tensor, reference_log_prob: torch.Tensor, log_ratio: torch.Tensor,
                    mask: torch.Tensor, max_log_ratio: float = MAX_LOG_IMPORTANCE_RATIO) -> dict[str, float]:
    """The four gap statistics shared by every logprob comparison; ``log_ratio`` is
    ``log_prob - reference_log_prob`` and ``mask`` selects at least one token."""
    selected_log_ratio = log_ratio[mask]
    return {
        # k1 estimator of KL(reference || current): E[log ref - log cur]
        "kl": (-selected_log_ratio).mean().item(),
        # k3 = w - 1 - log w: the REINFORCE Zero paper's per-token D3
        "k3_kl": _masked_mean(k3_divergence(log_ratio.clamp(max=max_log_ratio)), mask).item(),
        "bitwise_equal_fraction": (log_prob[mask] == reference_log_prob[mask]).float().mean().item(),
        "log_prob_abs_diff_max": selected_log_ratio.abs().max().item(),
    }


@torch.no_grad()
def log_prob_gap_metrics(log_prob: torch.Tensor, reference_log_prob: torch.Tensor,
                         response_mask: torch.Tensor) -> dict[str, float]:
    """How far one logprob of each sampled token lies from another, over the response tokens.

    With d = log p - log q per token (p = ``log_prob``, q = ``reference_log_prob``, both
    compared in fp32, or float64 when one is) and w = exp(d):

    * ``bitwise_equal_fraction`` = mean 1[log p == log q]: the share computed bit for bit alike;
    * ``kl`` = mean(-d): the k1 estimate of KL(q || p); k1 of chained gaps adds up exactly
      in real arithmetic (d_total = d_1 + d_2);
    * ``k3_kl`` = mean(w - 1 - d): the k3 estimate (D3), d capped at ``MAX_LOG_IMPORTANCE_RATIO``;
    * ``log_prob_abs_diff_max`` = max |d|.

    Returns an empty dict when the mask selects no token.
    """
    check_shapes("log_prob_gap_metrics", None, log_prob=log_prob, reference_log_prob=reference_log_prob,
                 response_mask=response_mask)
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    log_prob, reference_log_prob = _in_compute_dtype(log_prob, reference_log_prob)
    log_ratio = token_log_importance_ratio(log_prob, reference_log_prob)
    return _gap_statistics(log_prob, reference_log_prob, log_ratio, mask)


@torch.no_grad()
def importance_sampling_metrics(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                                response_mask: torch.Tensor) -> dict[str, float]:
    """Token-level statistics of w = pi/mu over the response tokens.

    ``rollout_corr/*`` keys mean exactly what verl's rollout-correction metrics mean
    (verl computes them in decoupled mode; in bypass mode with this plugin's losses they
    come from here). ``zero_mismatch/*`` keys are this plugin's own. The log-ratio cap is
    the loss's: ``log_ratio_cap(log_prob.dtype)``. Returns an empty dict when the mask
    selects no token.
    """
    check_shapes("importance_sampling_metrics", None, log_prob=log_prob, behaviour_log_prob=behaviour_log_prob,
                 response_mask=response_mask)
    mask = response_mask.bool()
    if not bool(mask.any()):
        return {}
    max_log_ratio = log_ratio_cap(log_prob.dtype)
    log_prob, behaviour_log_prob = _in_compute_dtype(log_prob, behaviour_log_prob)
    log_ratio = token_log_importance_ratio(log_prob, behaviour_log_prob)
    ratio = torch.exp(log_ratio.clamp(max=max_log_ratio))
    selected_ratio = ratio[mask]
    gap = _gap_statistics(log_prob, behaviour_log_prob, log_ratio, mask, max_log_ratio)
    return {
        "rollout_corr/rollout_is_mean": selected_ratio.mean().item(),
        "rollout_corr/rollout_is_min": selected_ratio.min().item(),
        "rollout_corr/rollout_is_max": selected_ratio.max().item(),
        "rollout_corr/rollout_is_eff_sample_size": effective_sample_size_fraction(ratio, mask).item(),
        # k1 estimator of KL(mu || pi): E_mu[log mu - log pi]  (verl: rollout_corr/kl)
        "rollout_corr/kl": gap["kl"],
        # k3 = w - 1 - log w with w = pi/mu  (verl: rollout_corr/k3_kl)
        "rollout_corr/k3_kl": gap["k3_kl"],
        # Kernel mismatch shows up here first: at lag 0 with aligned kernels this is 1.0.
        "zero_mismatch/bitwise_equal_fraction": gap["bitwise_equal_fraction"],
        "zero_mismatch/log_prob_abs_diff_max": gap["log_prob_abs_diff_max"],
        "zero_mismatch/is_log_ratio_capped_fraction":
            (log_ratio[mask] > max_log_ratio).float().mean().item(),
    }
