"""Plugin losses vs verl's built-in bypass-mode REINFORCE loss, forward + backward.

Same batch, same process, interleaved samples of ``--calls-per-sample`` calls each (alternating
order, repeated until the ratios settle, up to ``--max-repeats``). verl's comparison point is `bypass_mode` with loss_type=reinforce, token
IS and a huge threshold: the same gradient as REINFORCE Zero.

FlashREINFORCE computes one thing verl's loss does not: the per-token Bernoulli KL of its
sequence trust region ([FR] sec. 2), in float64 (ten elementwise transcendental functions per
token, against verl's one exp). That KL is timed on its own, interleaved with the losses, so the
last row shows what FlashREINFORCE costs beyond it.

Prints the host's load, CPUs and torch threads before and after; then, at the default torch
thread count and again at one thread (the whole comparison has the one-thread variant), per loss:
minimum and median wall ms, spread ((p75 - p25) / median), median CPU ms of this process, and the
ratios to verl of the minima and of the medians; rows are flagged UNRELIABLE when the host was
loaded or the ratios did not settle.

    .venv/bin/python benchmarks/bench_losses.py [--batch 256] [--length 2048] [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from timing import (UNRELIABLE, add_timing_arguments, at_threads, compare, format_rows, host_line, per_call,
                    row_header, thread_counts)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VERL = "verl bypass_mode reinforce"
KL_ONLY = "flash_reinforce's trust-region KL alone"
NAME_WIDTH = 42


def make_batch(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=generator)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    mu = -torch.rand(batch, length, generator=generator) * 4 - 1e-3
    pi = (mu + 0.05 * torch.randn(batch, length, generator=generator)).clamp(max=-1e-4)
    advantages = torch.randn(batch, 1, generator=generator).expand(batch, length) * mask
    return pi, mu, advantages.contiguous(), mask


def loss_step(fn, config, leaf, mu, advantages, mask) -> None:
    loss, _ = fn(old_log_prob=mu, log_prob=leaf, advantages=advantages, response_mask=mask,
                 loss_agg_mode="seq-mean-token-mean", config=config, rollout_is_weights=None)
    loss.backward()


def kl_step(formulas, pi, mu, mask) -> None:
    """The trust-region part of FlashREINFORCE alone: per-token Bernoulli KL and the gate."""
    token_kl = formulas.sampled_action_bernoulli_kl(pi, mu)
    formulas.sequence_trust_region(token_kl, mask, 0.01)


def print_comparison(comparison) -> None:
    print(f"torch threads {comparison.threads}: {comparison.line()}")
    print(row_header(NAME_WIDTH))
    for row in format_rows(comparison, baseline=VERL, name_width=NAME_WIDTH):
        print(row)
    # What FlashREINFORCE costs beyond its KL: the differences of the minima and of the medians.
    flash, kl, verl = (comparison.samples[name].wall for name in ("flash_reinforce", KL_ONLY, VERL))
    least, median = flash.minimum - kl.minimum, flash.median - kl.median
    print(f"{'flash_reinforce less its KL':<{NAME_WIDTH}}{least * 1e3:>10.2f}{median * 1e3:>11.2f}{'':>18}"
          f"{least / verl.minimum:>9.3f}x{median / verl.median:>9.3f}x"
          + (f"  {UNRELIABLE}" if comparison.unreliable else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls-per-sample", type=int, default=8,
                        help="loss calls timed together as one sample: a 10-30 ms call alone varies by half "
                             "from one call to the next on a 2-core host")
    add_timing_arguments(parser)
    args = parser.parse_args()
    print(host_line("before"), flush=True)

    import verl  # noqa: F401  (registers the plugin)

    from zero_mismatch_plugin.algorithms import formulas
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from support.verl_batches import actor_config

    pi, mu, advantages, mask = make_batch(args.batch, args.length)
    verl_config = actor_config("bypass_mode")
    object.__setattr__(verl_config.policy_loss, "rollout_correction", RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=1e9, bypass_mode=True, loss_type="reinforce"))
    losses = {
        VERL: (get_policy_loss_fn("bypass_mode"), verl_config),
        "reinforce_zero": (get_policy_loss_fn("reinforce_zero"), actor_config("reinforce_zero")),
        "flash_reinforce": (get_policy_loss_fn("flash_reinforce"), actor_config("flash_reinforce")),
    }
    calls = args.calls_per_sample
    leaves = []  # a fresh leaf per loss call, made untimed (setup) so only the losses are timed

    def new_leaves():
        leaves[:] = [pi.clone().requires_grad_(True) for _ in range(calls)]

    runs = {name: (lambda fn=fn, config=config: [loss_step(fn, config, leaf, mu, advantages, mask) for leaf in leaves])
            for name, (fn, config) in losses.items()}
    runs[KL_ONLY] = lambda: [kl_step(formulas, pi, mu, mask) for _ in range(calls)]
    setup = {name: new_leaves for name in losses}

    print(f"batch {args.batch} x {args.length} tokens, fp32, forward + backward; a sample is {calls} calls in a row "
          f"(times below per call), {args.repeats} interleaved samples or more until the ratios settle; "
          f"ratios: loss / verl")
    for threads in thread_counts(args):
        comparison = at_threads(threads, compare, runs, repeats=args.repeats, warmup=1,
                                max_repeats=args.max_repeats, setup=setup)
        print_comparison(per_call(comparison, calls))
    print(host_line("after"))


if __name__ == "__main__":
    main()
