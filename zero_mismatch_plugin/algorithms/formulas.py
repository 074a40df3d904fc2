"""The two algorithms' formulas, as small framework-free torch functions.

Nothing here imports verl, vLLM, Megatron or Hydra: each function takes plain tensors and
returns plain tensors, so it can be read against the paper and tested in isolation.
The verl adapter (``zero_mismatch_plugin.integrations.verl``) only wires these into verl.

References
----------
[RZ]  "Zero Mismatch, Simple Async RL: REINFORCE Zero, DeepSeek-V4.1 and Kimi K3.1"
      (REINFORCE Zero, Hu et al.), section 4 "The recipe".
[FR]  "FlashREINFORCE: Critic-Free Single-Rollout Asynchronous RL for Agentic Language
      Models" (Hu et al., 2026), "Method", equations 1-3.

Shapes: ``(B, T)`` token tensors are right-padded responses with a 0/1 ``response_mask``;
``(B,)`` tensors are per response. ``T_i`` is the number of unmasked tokens in row ``i``.

Padding: whatever a masked position holds (NaN, inf, any number), every function that takes
a mask selects with it (``torch.where``), never multiplies by it, so padding cannot reach a
result or a gradient.

Precision: the IS ratio and the Bernoulli KL are computed in float32 or wider whatever the
input dtype (16-bit log-probabilities are upcast), and their gradients reach a 16-bit
``log_prob`` in its own dtype.

Bad input: tensors that belong together must have exactly one shape; torch would broadcast
a ``(B, 1)`` mask over ``(B, T)`` values, or a ``(T,)`` logprob against ``(B, T)``, into a
wrong number without a word. Scalar arguments (thresholds, caps, counts) must be real
numbers in their range. Both raise ``ValueError`` naming the argument (:func:`check_shapes`,
:func:`check_real`); the checks read metadata and Python values only, never tensor data.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

# exp() of an fp32 log-ratio overflows to inf above ~88.7, and an inf ratio turns the
# gradient into NaN. A log-ratio of 50 is a ratio of 5e21: no real policy lag produces it,
# so capping there never changes a real update. Every cap is counted in the
# `zero_mismatch/is_log_ratio_capped_fraction` metric.
MAX_LOG_IMPORTANCE_RATIO = 50.0

# An fp32 log-probability that rounds to 0 means p = 1 to within 2^-24; probabilities are
# capped at 1 - 2^-24 so a confidently predicted token gives a finite Bernoulli KL, not inf.
MIN_BERNOULLI_COMPLEMENT = 2.0**-24


_LAYOUTS = {1: "(batch,)", 2: "(batch, response length)"}


def check_shapes(function: str, dims: int | None, *, shape: tuple[int, ...] | None = None, of: str = "",
                 **tensors: Any) -> tuple[int, ...]:
    """Refuse ``tensors`` unless every one is a ``torch.Tensor`` of one shape: ``shape`` when
    given (``of`` says whose), else the first tensor's; ``dims``, when given, is the number of
    dimensions that shape must have (1: ``(batch,)``, 2: ``(batch, response length)``).
    Raises ``ValueError`` naming ``function`` and the argument; returns the shape. Metadata
    only: no pass over the data, no host synchronisation."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{function}: {name} must be a torch.Tensor, got {type(value).__name__}.")
    first_name, first = next(iter(tensors.items()))
    expected = tuple(first.shape) if shape is None else tuple(shape)
    reference = of or first_name
    layout = _LAYOUTS.get(dims, "")
    if dims is not None and len(expected) != dims:
        raise ValueError(f"{function}: {reference} must be {dims}-D {layout}, got shape {expected}.")
    for name, value in tensors.items():
        if tuple(value.shape) != expected:
            raise ValueError(
                f"{function}: {name} has shape {tuple(value.shape)}, but {reference} has {expected}: pass "
                f"{name} with exactly that shape{' ' + layout if layout else ''}. Broadcasting is refused: it "
                "would change the result without an error.")
    return expected


def check_real(function: str, name: str, value: Any, what: str, *, minimum: float | None = None,
               strict: bool = False, maximum: float | None = None, finite: bool = True,
               integral: bool = False) -> float:
    """Refuse a scalar argument unless it is a real Python (or NumPy) number, not a bool, not
    NaN, finite unless ``finite`` is False, whole when ``integral``, and within
    ``[minimum, maximum]`` (``minimum`` excluded when ``strict``). Raises ``ValueError``
    "``function``: ``name`` must be ``what``, got ..."; returns the value as a float."""
    number = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            number = math.copysign(math.inf, value)
    below = minimum is not None and (number <= minimum if strict else number < minimum)
    if (math.isnan(number) or (finite and math.isinf(number)) or (integral and not number.is_integer())
            or below or (maximum is not None and number > maximum)):
        raise ValueError(f"{function}: {name} must be {what}, got {type(value).__name__} {value!r}.")
    return number


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the ratio and KL formulas compute in: float32, or wider when an input is."""
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result


def log_ratio_cap(gradient_dtype: torch.dtype) -> float:
    """The float-safety cap of the log IS ratio for a ``log_prob`` of ``gradient_dtype``.

    ``MAX_LOG_IMPORTANCE_RATIO`` (50) where e^50 fits the dtype (float32, bfloat16, float64);
    for float16 (max 65504) the largest integer whose exp fits: 11, a ratio of 6.0e4, so the
    gradient -A rho / (T_i B) that reaches an fp16 ``log_prob`` stays finite for
    |A| <= T_i B.
    """
    if not (isinstance(gradient_dtype, torch.dtype) and gradient_dtype.is_floating_point):
        raise ValueError(f"log_ratio_cap: gradient_dtype must be a floating-point torch.dtype (the dtype of "
                         f"log_prob), got {gradient_dtype!r}.")
    return min(MAX_LOG_IMPORTANCE_RATIO, float(math.floor(math.log(torch.finfo(gradient_dtype).max))))


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` holds, 0 elsewhere: selection, so NaN/inf padding never
    reaches a sum (0 * NaN would be NaN) and its gradient is exactly 0. ``mask`` has the shape
    of ``values``."""
    check_shapes("masked", None, values=values, mask=mask)
    return torch.where(mask.bool(), values, 0.0)


def valid_rows(response_mask: torch.Tensor) -> torch.Tensor:
    """Rows with at least one response token. verl pads batches with all-zero-mask rows,
    which must never enter a baseline. Returns bool ``(B,)``."""
    check_shapes("valid_rows", 2, response_mask=response_mask)
    return response_mask.sum(dim=-1) > 0


def outcome_reward(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome reward per response: R_i = sum_t r_{i,t} * m_{i,t}.

    verl places a scalar outcome reward on the last response token; summing over the
    mask recovers it (and is the natural reading of a per-token reward). [RZ] sec. 4,
    [FR] eq. 1 use this scalar R_i. Masked positions are never read. The sum runs in the
    dtype of ``token_level_rewards``: pass float64 when rewards may approach the float32 range.
    Both tensors are ``(B, T)``.
    """
    check_shapes("outcome_reward", 2, token_level_rewards=token_level_rewards, response_mask=response_mask)
    return masked(token_level_rewards, response_mask).sum(dim=-1)


def group_centered_advantage(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Zero advantage ([RZ] sec. 4, step 3): reward minus its group's mean.

        A_i = R_i - mean{ R_j : g_j = g_i, j valid }        (no std normalisation)

    * Invalid rows (verl's padding) get A = 0 and never enter a mean.
    * A group with one valid row gets A = 0: its only baseline is its own reward, so
      centering leaves no signal. (GRPO returns A = R there, an un-baselined reward on a
      different scale from every other row.) Such rows are returned in ``singleton`` so
      the caller can count them: they usually mean rollout.n=1 (use FlashREINFORCE's
      batch baseline instead) or a group split across batches.

    Args:
        rewards: ``(B,)`` outcome rewards.
        group_ids: ``(B,)`` integer group index >= 0 (e.g. the prompt uid mapped to 0..G-1).
        valid: ``(B,)`` bool, rows that carry a response.
    Returns:
        ``(advantages (B,), singleton (B,) bool)``.
    """
    check_shapes("group_centered_advantage", 1, rewards=rewards, group_ids=group_ids, valid=valid)
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_centered_advantage: group_ids must be an integer tensor (int64 group index "
                         f"0..G-1), got {group_ids.dtype}.")
    if valid.dtype != torch.bool:
        raise ValueError(f"group_centered_advantage: valid must be a bool tensor, got {valid.dtype}: pass "
                         "valid_rows(mask) or (mask.sum(-1) > 0).")
    rewards_valid = torch.where(valid, rewards, torch.zeros_like(rewards))
    # one pass and one host sync, as the max alone took before
    lowest, highest = torch.stack(torch.aminmax(group_ids)).tolist() if group_ids.numel() else (0, -1)
    if lowest < 0:
        raise ValueError(f"group_centered_advantage: group_ids must be >= 0 (an index 0..G-1), got {lowest}.")
    num_groups = int(highest) + 1
    group_sum = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    group_count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    group_sum.index_add_(0, group_ids, rewards_valid)
    group_count.index_add_(0, group_ids, valid.to(rewards.dtype))
    group_mean = group_sum / group_count.clamp(min=1)
    count_of_row = group_count[group_ids]
    singleton = valid & (count_of_row == 1)
    advantages = torch.where(valid & ~singleton, rewards - group_mean[group_ids], torch.zeros_like(rewards))
    return advantages, singleton


def batch_centered_advantage(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """FlashREINFORCE one-batch REINFORCE advantage ([FR] eq. 1):

        R_bar = (1/B) sum_j R_j,   A_i = R_i - R_bar

    where the mean runs over the B valid rows of the batch (independent prompts, one
    rollout each). Invalid rows (padding) get A = 0 and do not enter the mean. ``rewards``
    and ``valid`` (bool) are ``(B,)``.
    """
    check_shapes("batch_centered_advantage", 1, rewards=rewards, valid=valid)
    if valid.dtype != torch.bool:
        raise ValueError(f"batch_centered_advantage: valid must be a bool tensor, got {valid.dtype}: pass "
                         "valid_rows(mask) or (mask.sum(-1) > 0).")
    num_valid = valid.sum().clamp(min=1).to(rewards.dtype)
    batch_mean = torch.where(valid, rewards, torch.zeros_like(rewards)).sum() / num_valid
    return torch.where(valid, rewards - batch_mean, torch.zeros_like(rewards))


def token_log_importance_ratio(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor) -> torch.Tensor:
    """log rho_{i,t} = log pi_theta(a_{i,t}|h_{i,t}) - log mu_i(a_{i,t}|h_{i,t})   ([FR] eq. 2).

    Computed in :func:`compute_dtype` (float32 for 16-bit inputs); both inputs have one shape."""
    check_shapes("token_log_importance_ratio", None, log_prob=log_prob, behaviour_log_prob=behaviour_log_prob)
    dtype = compute_dtype(log_prob.dtype, behaviour_log_prob.dtype)
    return log_prob.to(dtype) - behaviour_log_prob.to(dtype)


def unclipped_importance_ratio(log_ratio: torch.Tensor, max_log_ratio: float = MAX_LOG_IMPORTANCE_RATIO
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """rho = exp(log pi - log mu), unclipped ([RZ] sec. 4, step 2: "no truncation").

    The only change is a float-safety cap of the *log*-ratio at ``max_log_ratio``
    (default ``MAX_LOG_IMPORTANCE_RATIO``, ratio 5e21; see :func:`log_ratio_cap`), far
    outside any real ratio, so that exp() never overflows into an inf ratio and a NaN
    gradient. A capped token counts e^cap in the loss and gets no gradient. Returns
    ``(rho, capped)`` where ``capped`` marks the tokens the cap touched. ``max_log_ratio`` must
    be > 0 and small enough that e^cap fits the dtype of ``log_ratio`` (88.7 for float32).
    """
    check_shapes("unclipped_importance_ratio", None, log_ratio=log_ratio)
    if not log_ratio.is_floating_point():
        raise ValueError(f"unclipped_importance_ratio: log_ratio must be a floating-point tensor, got "
                         f"{log_ratio.dtype}.")
    largest = math.log(torch.finfo(log_ratio.dtype).max)
    check_real("unclipped_importance_ratio", "max_log_ratio", max_log_ratio,
               f"a number > 0 and <= {largest:.4g}, so that e^cap fits {log_ratio.dtype} (use "
               "log_ratio_cap(log_prob.dtype))", minimum=0.0, strict=True, maximum=largest)
    capped = log_ratio > max_log_ratio
    return torch.exp(log_ratio.clamp(max=max_log_ratio)), capped


def sequence_mean_token_mean(
    values: torch.Tensor, mask: torch.Tensor, num_sequences: float | int | None = None
) -> torch.Tensor:
    """Sample-mean aggregation ([FR] eq. 3, [RZ] sec. 4):

        (1/B) sum_i (1/T_i) sum_t v_{i,t} m_{i,t}

    Each response gets equal weight whatever its length. ``B`` defaults to the number of
    rows; pass the global count under data parallelism. Rows with T_i = 0 add 0 but still
    count in B (FlashREINFORCE's rejected rows must not rescale the admitted ones). With no
    row (B = 0) or no token at all the result is 0, still connected to ``values``' graph
    (its gradient is 0). ``values`` and ``mask`` are ``(B, T)``; ``num_sequences`` is a whole
    number > 0 (not a bool).
    """
    check_shapes("sequence_mean_token_mean", 2, values=values, mask=mask)
    if num_sequences is not None:
        check_real("sequence_mean_token_mean", "num_sequences", num_sequences,
                   "a positive count of responses (a whole number B > 0), or None for the number of rows",
                   minimum=0, strict=True, integral=True)
    tokens_per_row = mask.to(values.dtype).sum(dim=-1)
    row_means = masked(values, mask).sum(dim=-1) / tokens_per_row.clamp(min=1)
    denominator = max(values.shape[0], 1) if num_sequences is None else num_sequences
    return row_means.sum() / denominator


def reinforce_zero_token_loss(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                              advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token REINFORCE Zero loss ([RZ] sec. 4):

        L(theta) = -(1/B) sum_i (1/T_i) sum_t A_i * pi_theta(a_it|h_it) / mu_i(a_it|h_it)

    This returns the per-token term ``-A_i * rho_it``; aggregate it with
    :func:`sequence_mean_token_mean`. Its gradient is ``-A_i * rho_it * grad log pi``: the
    unclipped token-IS REINFORCE gradient. ``advantages`` is ``(B,)`` or ``(B, T)``.
    The term is computed in :func:`compute_dtype` (float32 for 16-bit inputs), with the
    log-ratio capped at ``log_ratio_cap(log_prob.dtype)``; the gradient reaches ``log_prob``
    in its own dtype. Padding is the caller's: pass finite values at masked positions
    (:func:`masked`). ``log_prob`` and ``behaviour_log_prob`` are ``(B, T)``. Returns
    ``(loss_per_token, capped)``.
    """
    _check_token_loss_inputs("reinforce_zero_token_loss", log_prob, behaviour_log_prob, advantages)
    return _token_loss(log_prob, behaviour_log_prob, advantages)


def _check_token_loss_inputs(function: str, log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                             advantages: torch.Tensor) -> None:
    """Logprobs ``(B, T)`` of one shape, advantages ``(B,)`` or ``(B, T)``: never a length-1
    or ``(T,)`` tensor broadcast over the batch."""
    shape = check_shapes(function, 2, log_prob=log_prob, behaviour_log_prob=behaviour_log_prob)
    check_shapes(function, None, advantages=advantages)
    if tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(
            f"{function}: advantages has shape {tuple(advantages.shape)}, but log_prob has {shape}: pass one "
            f"advantage per row {shape[:1]} or per token {shape}. Broadcasting is refused: it would change the "
            "result without an error.")


def _token_loss(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, advantages: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """-A_i rho_it for checked inputs (see :func:`reinforce_zero_token_loss`)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = token_log_importance_ratio(log_prob, behaviour_log_prob)
    ratio, capped = unclipped_importance_ratio(log_ratio, log_ratio_cap(log_prob.dtype))
    return -advantages.to(ratio.dtype) * ratio, capped


def _log_one_minus_exp(log_x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(log_x)) for log_x <= 0, accurate at both ends (Maechler 2012)."""
    return torch.where(
        log_x > -math.log(2.0),
        torch.log(-torch.expm1(log_x)),
        torch.log1p(-torch.exp(log_x)),
    )


def bernoulli_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) || Bern(p)) = q log(q/p) + (1-q) log((1-q)/(1-p)), from log-probabilities.

    Computed in float64 from log q, log p, with 0 * log 0 taken as 0. Both probabilities
    are capped at 1 - ``MIN_BERNOULLI_COMPLEMENT`` (the resolution of an fp32
    log-probability near 0), so a token that one side predicts with probability 1.0
    gives a large but finite value; capping both sides keeps the result a true KL (>= 0).
    Result has :func:`compute_dtype` of the inputs (float32 for 16-bit inputs, whose range
    would turn large KLs into inf). Both inputs have one shape.
    """
    check_shapes("bernoulli_kl", None, log_q=log_q, log_p=log_p)
    out_dtype = compute_dtype(log_q.dtype, log_p.dtype)
    max_log_prob = math.log1p(-MIN_BERNOULLI_COMPLEMENT)
    log_q = log_q.double().clamp(max=max_log_prob)
    log_p = log_p.double().clamp(max=max_log_prob)
    q = torch.exp(log_q)
    log_one_minus_q = _log_one_minus_exp(log_q)
    log_one_minus_p = _log_one_minus_exp(log_p)
    taken = torch.where(q > 0, q * (log_q - log_p), torch.zeros_like(q))
    not_taken = torch.exp(log_one_minus_q) * (log_one_minus_q - log_one_minus_p)
    return (taken + not_taken).to(out_dtype)


def sampled_action_bernoulli_kl(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                                direction: str = "behaviour_to_learner") -> torch.Tensor:
    """FlashREINFORCE's per-token drift proxy D_{i,t} ([FR] sec. 2): the KL between the
    Bernoulli "sample a_{i,t} or not" under the behaviour policy (q = mu(a|h)) and the
    learner (p = pi(a|h)).

    * ``"behaviour_to_learner"`` (default): KL(Bern(q) || Bern(p));
    * ``"learner_to_behaviour"``: KL(Bern(p) || Bern(q)).
    """
    if direction == "behaviour_to_learner":
        return bernoulli_kl(behaviour_log_prob, log_prob)
    if direction == "learner_to_behaviour":
        return bernoulli_kl(log_prob, behaviour_log_prob)
    raise ValueError(
        f"unknown KL direction {direction!r}: use 'behaviour_to_learner' or 'learner_to_behaviour'"
    )


def sequence_trust_region(token_kl: torch.Tensor, mask: torch.Tensor, delta: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashREINFORCE sequence trust region ([FR] sec. 2):

        D_bar_i = (1/T_i) sum_t D_{i,t},     m_i = 1[D_bar_i <= delta]

    Admission is a hard decision: no gradient flows through it. Rows with T_i = 0 have
    D_bar_i = 0. Masked positions of ``token_kl`` are never read. ``token_kl`` and ``mask`` are
    ``(B, T)``; ``delta`` is a number >= 0 (inf admits every row; NaN, which would reject every
    row, is refused). Returns ``(admitted (B,) bool, mean_kl (B,))``.
    """
    check_shapes("sequence_trust_region", 2, token_kl=token_kl, mask=mask)
    check_real("sequence_trust_region", "delta", delta,
               "a number >= 0 (the largest mean KL admitted; inf admits every row)", minimum=0.0, finite=False)
    with torch.no_grad():
        tokens_per_row = mask.to(token_kl.dtype).sum(-1)
        mean_kl = masked(token_kl.detach(), mask).sum(-1) / tokens_per_row.clamp(min=1)
        return mean_kl <= delta, mean_kl


def flash_reinforce_token_loss(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                               advantages: torch.Tensor, admitted: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FlashREINFORCE loss ([FR] eq. 3):

        J_FR(theta) = (1/B) sum_i (m_i A_i / T_i) sum_t rho_{i,t},     loss = -J_FR

    Returns the per-token term ``-m_i A_i rho_it`` (exactly 0, with a zero gradient, on
    rejected rows); aggregate with :func:`sequence_mean_token_mean` using the full B so
    rejection never rescales admitted rows. Shapes as in :func:`reinforce_zero_token_loss`;
    ``admitted`` is bool ``(B,)``. Returns ``(loss_per_token, capped)``.
    """
    _check_token_loss_inputs("flash_reinforce_token_loss", log_prob, behaviour_log_prob, advantages)
    check_shapes("flash_reinforce_token_loss", 1, shape=log_prob.shape[:1], of="log_prob's rows",
                 admitted=admitted)
    if admitted.dtype != torch.bool:
        raise ValueError(f"flash_reinforce_token_loss: admitted must be a bool tensor (the trust-region gate of "
                         f"sequence_trust_region), got {admitted.dtype}.")
    loss, capped = _token_loss(log_prob, behaviour_log_prob, advantages)
    # where(), not multiplication: the rejected branch may hold a huge ratio.
    return torch.where(admitted.unsqueeze(-1), loss, torch.zeros_like(loss)), capped


def k3_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token D3 ([RZ] sec. 3, Fig. 1): w - 1 - log w with w = pi/mu; 0 iff w = 1.
    The same quantity is called the k3 estimator (verl's ``rollout_corr/k3_kl``)."""
    return torch.expm1(log_ratio) - log_ratio


def effective_sample_size_fraction(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size of the token IS weights:
    ESS/N = (sum w)^2 / (N sum w^2), in (0, 1]; 1 when every w is equal. Masked positions
    are never read. The weights are divided by their largest first (ESS does not change):
    a capped ratio e^50 squared would overflow fp32. ``ratio`` and ``mask`` have one shape."""
    check_shapes("effective_sample_size_fraction", None, ratio=ratio, mask=mask)
    w = masked(ratio, mask)
    w = w / w.max().clamp(min=torch.finfo(ratio.dtype).tiny) if w.numel() else w
    n = mask.to(ratio.dtype).sum().clamp(min=1)
    return w.sum() ** 2 / (n * (w * w).sum()).clamp(min=torch.finfo(ratio.dtype).tiny)
