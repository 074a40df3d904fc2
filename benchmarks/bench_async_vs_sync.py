"""Asynchronous vs synchronous updates per second: the demo's loop, same settings, one engine.

Synchronous = lag 0: the engine samples only after the learner's update and weight push, and the
learner waits for those fresh samples. Asynchronous = lag K: the engine keeps sampling with the
newest weights it has while the learner updates. Runs alternate (sync, async, sync, ...) so load
from other processes on the machine hits both alike; the median of each is compared.

The extra own-version forward the demo does at lag > 0 (a diagnostic, not part of the algorithm)
is off by default here; ``--own-version-check`` includes it.

    .venv/bin/python benchmarks/bench_async_vs_sync.py [--updates 60] [--repeats 3] [--lag 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _median_metric(result, key: str) -> float:
    return statistics.median(r.metrics[key] for r in result.records[1:])  # first update warms up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lag", type=int, default=2, help="K of the asynchronous runs")
    parser.add_argument("--kernels", choices=("aligned", "standard"), default="aligned")
    parser.add_argument("--algo", choices=("reinforce_zero", "flash_reinforce"), default="reinforce_zero")
    parser.add_argument("--own-version-check", action="store_true")
    args = parser.parse_args()

    from zero_mismatch_plugin.demo import DemoConfig, run_demo
    from zero_mismatch_plugin.aligned.runtime import shutdown_engine
    from zero_mismatch_plugin.demo.rollout import start_engine
    from zero_mismatch_plugin.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", family="llama", seed=0)
        base = dict(algo=args.algo, kernels=args.kernels, own_version_check=args.own_version_check)
        llm = start_engine(model_dir, DemoConfig().max_model_len)
        try:
            run_demo(DemoConfig(**base, lag=0, updates=5), llm, model_dir)  # warm-up
            rows = {"sync": [], "async": []}
            for repeat in range(args.repeats):
                for mode, lag in (("sync", 0), ("async", args.lag)):
                    result = run_demo(DemoConfig(**base, lag=lag, updates=args.updates), llm, model_dir)
                    rows[mode].append(result)
                    print(f"repeat {repeat + 1} {mode:<5} lag {lag}: "
                          f"{args.updates / result.loop_seconds:6.2f} updates/s", flush=True)
        finally:
            shutdown_engine(llm)

    def rate(result):
        return len(result.records) / result.loop_seconds

    sync_rate = statistics.median(rate(r) for r in rows["sync"])
    async_rate = statistics.median(rate(r) for r in rows["async"])
    print()
    print(f"settings: {args.algo}, {args.kernels} kernels, {args.updates} updates x {args.repeats} repeats, "
          f"32 sequences x 16 tokens per update, own-version check {'on' if args.own_version_check else 'off'}")
    print(f"{'':<28}{'synchronous (lag 0)':>22}{f'asynchronous (lag {args.lag})':>26}")
    print(f"{'updates/s (median)':<28}{sync_rate:>22.2f}{async_rate:>26.2f}")
    for label, key in (("learner update s (median)", "timing_s/update"),
                       ("generate s per update", "timing_s/generate"),
                       ("learner waits s (median)", "timing_s/wait_for_rollout")):
        sync_value = statistics.median(_median_metric(r, key) for r in rows["sync"])
        async_value = statistics.median(_median_metric(r, key) for r in rows["async"])
        print(f"{label:<28}{sync_value:>22.3f}{async_value:>26.3f}")
    lag_seen = max(r.metrics["training/off_policy/trajectory_staleness/max"] for res in rows["async"]
                   for r in res.records)
    print(f"{'lag max':<28}{0:>22}{int(lag_seen):>26}")
    print(f"\nasync / sync = {async_rate / sync_rate:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
