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
    token_log_importance_ratio,
)


def _in_compute_dtype(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Detached copies in float32 (or float64 when an input is): 16-bit inputs are
    compared and exponentiated in fp32, float64 inputs keep their bits."""
    dtype = compute_dtype(*(tensor.dtype for tensor in tensors))
    return [tensor.detach().to(dtype) for tensor in tensors]


def _masked_log_ratio(log_prob: torch.Tensor, reference_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log_prob - reference_log_prob`` at response tokens, exactly 0 elsewhere: every statistic
    below reads the padding as a zero log-ratio (ratio 1, D3 0) and masks what a zero would still
    count. Reductions over the whole tensor replace boolean selections (``x[mask]``), which cost
    three quarters of the metrics' time in a nonzero and a gather each."""
    return torch.where(mask, token_log_importance_ratio(log_prob, reference_log_prob), 0.0)


def _gap_statistics(log_prob: torch.Tensor, reference_log_prob: torch.Tensor, log_ratio: torch.Tensor,
                    mask: torch.Tensor, tokens: torch.Tensor,
                    max_log_ratio: float = MAX_LOG_IMPORTANCE_RATIO) -> dict[str, torch.Tensor]:
    """The four gap statistics shared by every logprob comparison, as 0-d tensors; ``log_ratio``
    is :func:`_masked_log_ratio`, ``tokens`` the count of response tokens (at least one)."""
    lowest, highest = torch.aminmax(log_ratio)
    return {
        # k1 estimator of KL(reference || current): E[log ref - log cur]
        "kl": -log_ratio.sum() / tokens,
        # k3 = w - 1 - log w: the REINFORCE Zero paper's per-token D3 (0 at padding)
        "k3_kl": k3_divergence(log_ratio.clamp(max=max_log_ratio)).sum() / tokens,
        "bitwise_equal_fraction": ((log_prob == reference_log_prob) & mask).sum() / tokens,
        "log_prob_abs_diff_max": torch.maximum(-lowest, highest),
    }


def _as_floats(statistics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Every statistic read back at once (one stack, one copy to Python floats)."""
    values = torch.stack([value.to(torch.float64) for value in statistics.values()]).tolist()
    return dict(zip(statistics, values))


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
    log_ratio = _masked_log_ratio(log_prob, reference_log_prob, mask)
    tokens = mask.sum().to(torch.float64)  # exact past 2^24 tokens
    return _as_floats(_gap_statistics(log_prob, reference_log_prob, log_ratio, mask, tokens))


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
    log_ratio = _masked_log_ratio(log_prob, behaviour_log_prob, mask)
    tokens = mask.sum().to(torch.float64)  # exact past 2^24 tokens
    ratio = torch.exp(log_ratio.clamp(max=max_log_ratio))  # 1 at padding
    selected_ratio = torch.where(mask, ratio, 0.0)
    gap = _gap_statistics(log_prob, behaviour_log_prob, log_ratio, mask, tokens, max_log_ratio)
    statistics = {
        "rollout_corr/rollout_is_mean": selected_ratio.sum() / tokens,
        "rollout_corr/rollout_is_min": torch.where(mask, ratio, torch.inf).amin(),
        "rollout_corr/rollout_is_max": selected_ratio.amax(),
        "rollout_corr/rollout_is_eff_sample_size": effective_sample_size_fraction(ratio, mask),
        # k1 estimator of KL(mu || pi): E_mu[log mu - log pi]  (verl: rollout_corr/kl)
        "rollout_corr/kl": gap["kl"],
        # k3 = w - 1 - log w with w = pi/mu  (verl: rollout_corr/k3_kl)
        "rollout_corr/k3_kl": gap["k3_kl"],
        # Kernel mismatch shows up here first: at lag 0 with aligned kernels this is 1.0.
        "zero_mismatch/bitwise_equal_fraction": gap["bitwise_equal_fraction"],
        "zero_mismatch/log_prob_abs_diff_max": gap["log_prob_abs_diff_max"],
        # Padding's log-ratio is 0, below any cap.
        "zero_mismatch/is_log_ratio_capped_fraction": (log_ratio > max_log_ratio).sum() / tokens,
    }
    return _as_floats(statistics)
