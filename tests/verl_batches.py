"""Builders for the inputs verl hands to estimators and losses, made with verl's own types."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

PLUGIN_CONFIG_TARGET = "zero_mismatch_plugin.verl_adapter.config.ZeroMismatchPolicyLossConfig"


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
