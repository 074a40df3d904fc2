"""Plugin losses vs verl's built-in bypass-mode REINFORCE loss, forward + backward.

Same batch, same process, interleaved runs; prints the median time of each and the ratio
of medians (plugin / verl). verl's comparison point is `bypass_mode` with
loss_type=reinforce, token IS and a huge threshold: the same gradient as REINFORCE Zero.

FlashREINFORCE computes one thing verl's loss does not: the per-token Bernoulli KL of its
sequence trust region ([FR] sec. 2), in float64 (ten elementwise transcendental functions per
token, against verl's one exp). That KL is timed on its own, interleaved with the losses, so the
last line shows what FlashREINFORCE costs beyond it.

    .venv/bin/python benchmarks/bench_losses.py [--batch 256] [--length 2048] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def make_batch(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=generator)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    mu = -torch.rand(batch, length, generator=generator) * 4 - 1e-3
    pi = (mu + 0.05 * torch.randn(batch, length, generator=generator)).clamp(max=-1e-4)
    advantages = torch.randn(batch, 1, generator=generator).expand(batch, length) * mask
    return pi, mu, advantages.contiguous(), mask


def time_loss(fn, config, pi, mu, advantages, mask) -> float:
    leaf = pi.clone().requires_grad_(True)
    start = time.perf_counter()
    loss, _ = fn(old_log_prob=mu, log_prob=leaf, advantages=advantages, response_mask=mask,
                 loss_agg_mode="seq-mean-token-mean", config=config, rollout_is_weights=None)
    loss.backward()
    return time.perf_counter() - start


def time_kl(formulas, pi, mu, mask) -> float:
    """The trust-region part of FlashREINFORCE alone: per-token Bernoulli KL and the gate."""
    start = time.perf_counter()
    token_kl = formulas.sampled_action_bernoulli_kl(pi, mu)
    formulas.sequence_trust_region(token_kl, mask, 0.01)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    import verl  # noqa: F401  (registers the plugin)

    from zero_mismatch_plugin.algorithms import formulas
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from support.verl_batches import actor_config

    pi, mu, advantages, mask = make_batch(args.batch, args.length)
    verl_config = actor_config("bypass_mode")
    object.__setattr__(verl_config.policy_loss, "rollout_correction", RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=1e9, bypass_mode=True, loss_type="reinforce"))
    contenders = {
        "verl bypass_mode reinforce": (get_policy_loss_fn("bypass_mode"), verl_config),
        "reinforce_zero": (get_policy_loss_fn("reinforce_zero"), actor_config("reinforce_zero")),
        "flash_reinforce": (get_policy_loss_fn("flash_reinforce"), actor_config("flash_reinforce")),
    }
    kl_only = "flash_reinforce's trust-region KL alone"
    times: dict[str, list[float]] = {name: [] for name in [*contenders, kl_only]}
    runs = {name: (lambda fn=fn, config=config: time_loss(fn, config, pi, mu, advantages, mask))
            for name, (fn, config) in contenders.items()}
    runs[kl_only] = lambda: time_kl(formulas, pi, mu, mask)
    for run in runs.values():  # warm-up
        run()
    for repeat in range(args.repeats):
        order = list(runs.items())
        if repeat % 2:
            order.reverse()
        for name, run in order:
            times[name].append(run())

    baseline = statistics.median(times["verl bypass_mode reinforce"])
    print(f"batch {args.batch} x {args.length} tokens, fp32, CPU threads {torch.get_num_threads()}, "
          f"{args.repeats} interleaved repeats, forward + backward; host ISA "
          f"{torch.backends.cpu.get_cpu_capability()} (the figures depend on it)")
    print(f"{'loss':<40} {'median ms':>10} {'ratio vs verl':>14}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<40} {median * 1e3:>10.1f} {median / baseline:>13.2f}x")
    beyond_kl = statistics.median(times["flash_reinforce"]) - statistics.median(times[kl_only])
    print(f"{'flash_reinforce less its KL':<40} {beyond_kl * 1e3:>10.1f} {beyond_kl / baseline:>13.2f}x")


if __name__ == "__main__":
    main()
