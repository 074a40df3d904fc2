"""Builders for the inputs verl hands to estimators and losses, made with verl's own types."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

PLUGIN_CONFIG_TARGET = "zero_mismatch_plugin.integrations.verl.config.ZeroMismatchPolicyLossConfig"


def actor_config(loss_mode: str, **policy_loss_fields):
    """A real FSDPActorConfig whose policy_loss is built from its _target_, as verl's workers do."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPActorConfig

    policy_loss = omega_conf_to_dataclass(OmegaConf.create(
        {"_target_": PLUGIN_CONFIG_TARGET, "loss_mode": loss_mode, **policy_loss_fields}))
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                           loss_agg_mode="seq-mean-token-mean", policy_loss=policy_loss,
                           use_dynamic_bsz=False, rollout_n=1)


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def ppo_loss_call(config, log_prob_rows, old_log_prob_rows, advantage_rows, prompt_lens,
                  global_batch_size: int, dp_size: int = 1, rollout_log_prob_rows=None):
    """Run verl's ppo_loss on one micro-batch given as per-row response tensors.

    ``log_prob_rows[i]`` is the trainer's response logprob of row i (requires_grad to get
    gradients); the packed model output verl expects is rebuilt around it.
    ``rollout_log_prob_rows``, when given, become the batch's ``rollout_log_probs`` (the
    rollout engine's mu, next to an ``old_log_probs`` that is the trainer's recompute).
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    response_lens = [len(r) for r in old_log_prob_rows]
    fields = {
        "prompts": _nested([torch.zeros(p, dtype=torch.long) for p in prompt_lens]),
        "responses": _nested([torch.zeros(r, dtype=torch.long) for r in response_lens]),
        "response_mask": _nested([torch.ones(r, dtype=old_log_prob_rows[0].dtype) for r in response_lens]),
        "old_log_probs": _nested([r.detach() for r in old_log_prob_rows]),
        "advantages": _nested([a.detach() for a in advantage_rows]),
    }
    if rollout_log_prob_rows is not None:
        fields["rollout_log_probs"] = _nested([r.detach() for r in rollout_log_prob_rows])
    data = tu.get_tensordict(
        fields,
        non_tensor_dict={"dp_size": dp_size, "batch_num_tokens": sum(response_lens),
                         "global_batch_size": global_batch_size},
    )
    # Model output is packed over prompt + response; position p-1+t predicts response token t.
    packed = []
    for prompt_len, row in zip(prompt_lens, log_prob_rows):
        packed.append(torch.cat([torch.zeros(prompt_len - 1, dtype=row.dtype), row, torch.zeros(1, dtype=row.dtype)]))
    loss, metrics = ppo_loss(config, {"log_probs": _nested(packed)}, data)
    return loss, {key: (float(metric.aggregate()) if hasattr(metric, "aggregate") else metric)
                  for key, metric in metrics.items()}


# ----- padded (B, T) batches, as verl's ppo_loss hands them to a policy loss --------------------

PADDED_RESPONSE_LENS = (5, 3, 7, 1, 0, 4)  # row 4 is verl's padding row (mask all 0)
PADDED_ADVANTAGES = (0.7, -0.3, 1.2, -1.0, 0.0, 0.4)


def padded_loss_batch(seed: int = 0, log_ratio_scale: float = 0.3, dtype: torch.dtype = torch.float32):
    """``(pi, mu, pi_old, advantages, mask)``, right-padded ``(B, T)`` with a bool mask and 0 at
    every padded position; pi_old lies between mu and pi (the trainer's recompute)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(PADDED_RESPONSE_LENS)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(PADDED_RESPONSE_LENS).unsqueeze(1)

    def noise():
        return log_ratio_scale / 2 * torch.randn(mask.shape, generator=generator, dtype=torch.float64)

    mu = -torch.rand(mask.shape, generator=generator, dtype=torch.float64) * 3 - 0.01
    old = (mu + noise()).clamp(max=-1e-3)
    pi = (old + noise()).clamp(max=-1e-3)
    advantages = torch.tensor(PADDED_ADVANTAGES, dtype=torch.float64).unsqueeze(-1).expand(mask.shape)
    return tuple(torch.where(mask, t, 0.0).to(dtype) for t in (pi, mu, old, advantages)) + (mask,)


def loss_call(loss_mode: str, log_prob, old_log_prob, advantages, response_mask, config=None, **keywords):
    """One direct call of a plugin loss as verl's ppo_loss makes it (``loss_agg_mode`` from the
    config, ``rollout_is_weights`` None unless given), then backward.
    Returns ``(loss, grad of log_prob, metrics)``; the loss is detached."""
    from zero_mismatch_plugin.integrations.verl.losses import flash_reinforce_policy_loss, reinforce_zero_policy_loss

    loss_fn = {"reinforce_zero": reinforce_zero_policy_loss, "flash_reinforce": flash_reinforce_policy_loss}[loss_mode]
    config = actor_config(loss_mode) if config is None else config
    leaf = log_prob.clone().requires_grad_(True) if log_prob.is_floating_point() else log_prob
    keywords.setdefault("rollout_is_weights", None)
    loss, metrics = loss_fn(old_log_prob=old_log_prob, log_prob=leaf, advantages=advantages,
                            response_mask=response_mask, loss_agg_mode=config.loss_agg_mode, config=config,
                            **keywords)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def fill_padding(tensor: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``tensor`` with ``value`` at every padded position (mask 0)."""
    return torch.where(mask, tensor, torch.tensor(value, dtype=tensor.dtype))


def reference_reinforce(log_prob, behaviour_log_prob, advantages, mask, max_log_ratio: float):
    """REINFORCE Zero's loss and gradient in float64 from the closed form, for checking the
    losses at other precisions: loss = -(1/B) sum_i (1/T_i) sum_t A_i rho_it over the rows with
    tokens, d loss / d log pi_it = -A_i rho_it / (T_i B), 0 where the log-ratio is capped."""
    log_ratio = torch.where(mask, log_prob.double() - behaviour_log_prob.double(), 0.0)
    ratio = torch.exp(log_ratio.clamp(max=max_log_ratio))
    tokens = mask.sum(-1, keepdim=True).clamp(min=1)
    rows = max(int((mask.sum(-1) > 0).sum()), 1)
    term = torch.where(mask, -advantages.double() * ratio, 0.0)
    loss = (term / tokens).sum() / rows
    grad = torch.where(mask & (log_ratio <= max_log_ratio), term / tokens / rows, 0.0)
    capped_fraction = (log_ratio[mask] > max_log_ratio).double().mean().item()
    return loss.item(), grad, capped_fraction


def extreme_log_ratio_batch(dtype: torch.dtype):
    """``(pi, mu, advantages, mask)`` with log-ratios from -3 to 60 by column (exp overflows fp16
    above ~11.09, the fp32 cap is 50), every logprob <= -1."""
    _, base, _, advantages, mask = padded_loss_batch(dtype=torch.float64)
    log_ratios = torch.tensor([0.25, -3.0, 10.5, 11.5, 12.0, 20.0, 60.0], dtype=torch.float64)
    mu = base - 1.0 - log_ratios.clamp(min=0)
    pi = mu + log_ratios
    return tuple(torch.where(mask, t, 0.0).to(dtype) for t in (pi, mu, advantages)) + (mask,)
