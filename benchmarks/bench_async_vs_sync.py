"""Asynchronous vs synchronous updates per second: the demo's loop, same settings, one engine.

Synchronous = lag 0: the engine samples only after the learner's update and weight push, and the
learner waits for those fresh samples. Asynchronous = lag K: the engine keeps sampling with the
newest weights it has while the learner updates. Runs alternate (sync, async, sync, ...) so load
from other processes on the machine hits both alike; the median of each is compared, and so is
each async run with the sync run just before it (the headline: the median of those ratios).

Besides the rates it prints where the CPU went during the runs, in cores (CPU seconds / wall
seconds): the learner's process, the engine's process, and every other process on the machine.
Overlap can only pay while learner + engine stay below the cores the other processes leave free.

The extra own-version forward the demo does at lag > 0 (a diagnostic, not part of the algorithm)
is off by default here; ``--own-version-check`` includes it.

Also prints the host's load, CPUs and torch threads before and after, and per mode, in the shared
row format: minimum and median seconds per update (as ms), their spread ((p75 - p25) / median), the
learner process's CPU ms per update, and the ratio async / sync of the minima and of the medians (in
time: below 1 is async faster); rows are flagged UNRELIABLE when the host was loaded or the ratio
disagreed between the earlier and the later repeats (the repeats are fixed: each is a whole run).
The learner is the in-process part: ``--one-thread`` runs every repeat again with the learner at
one torch thread (off by default, as it doubles the run time; the engine keeps its own threads).

    .venv/bin/python benchmarks/bench_async_vs_sync.py [--updates 60] [--repeats 5] [--lag 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from timing import Comparison, Samples, at_threads, format_rows, halves_agree, host_is_loaded, host_line, row_header

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _system_busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (Linux /proc/stat)."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _process_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@dataclass
class CpuShare:
    """Cores used during one run: this (learner) process, the engine process, everything else."""

    learner: float
    engine: float
    others: float


class CpuMeter:
    def __init__(self, engine_pid: int):
        self.engine_pid = engine_pid

    def __enter__(self) -> "CpuMeter":
        self._start = (time.perf_counter(), time.process_time(), _process_seconds(self.engine_pid),
                       _system_busy_seconds())
        return self

    def __exit__(self, *exc) -> None:
        wall0, learner0, engine0, system0 = self._start
        wall = time.perf_counter() - wall0
        learner = time.process_time() - learner0
        engine = _process_seconds(self.engine_pid) - engine0
        others = (_system_busy_seconds() - system0) - learner - engine
        self.share = CpuShare(learner / wall, engine / wall, max(0.0, others) / wall)
        self.learner_seconds = learner


def _median_metric(result, key: str) -> float:
    return statistics.median(r.metrics[key] for r in result.records[1:])  # first update warms up


def _rate(result) -> float:
    return len(result.records) / result.loop_seconds


def _row(label: str, sync_value, async_value, fmt: str) -> str:
    return f"{label:<30}{sync_value:>22{fmt}}{async_value:>26{fmt}}"


def _print_table(args, config, rows, shares) -> None:
    sync_rate = statistics.median(_rate(r) for r in rows["sync"])
    async_rate = statistics.median(_rate(r) for r in rows["async"])
    sequences = config.prompts_per_update * config.samples_per_prompt
    print()
    print(f"settings: {args.algo}, {args.kernels} kernels, {args.updates} updates x {args.repeats} repeats, "
          f"{sequences} sequences x {config.response_tokens} tokens per update in {config.chunks_per_update} "
          f"chunks, own-version check {'on' if args.own_version_check else 'off'}, {os.cpu_count()} CPUs")
    print(f"{'':<30}{'synchronous (lag 0)':>22}{f'asynchronous (lag {args.lag})':>26}")
    print(_row("updates/s (median)", sync_rate, async_rate, ".2f"))
    for label, key in (("learner update s (median)", "timing_s/update"),
                       ("generate s per update", "timing_s/generate"),
                       ("weight load s per update", "timing_s/weight_load"),
                       ("learner waits s (median)", "timing_s/wait_for_rollout")):
        sync_value = statistics.median(_median_metric(r, key) for r in rows["sync"])
        async_value = statistics.median(_median_metric(r, key) for r in rows["async"])
        print(_row(label, sync_value, async_value, ".3f"))
    for label, field in (("cores: learner process", "learner"), ("cores: engine process", "engine"),
                         ("cores: other processes", "others")):
        print(_row(label, statistics.median(getattr(s, field) for s in shares["sync"]),
                   statistics.median(getattr(s, field) for s in shares["async"]), ".2f"))
    lag_seen = max(r.metrics["training/off_policy/trajectory_staleness/max"] for res in rows["async"]
                   for r in res.records)
    print(_row("lag max", 0, int(lag_seen), ""))
    pair_ratios = [_rate(a) / _rate(s) for s, a in zip(rows["sync"], rows["async"])]
    print(f"\nasync / sync per repeat: {', '.join(f'{r:.2f}' for r in pair_ratios)}")
    print(f"ratio of the medians: {async_rate / sync_rate:.2f}x")
    print(f"async / sync = {statistics.median(pair_ratios):.2f}x (median over repeats)")


def _print_rows(rows, learner_cpu, loaded: tuple[bool, bool]) -> None:
    """Seconds per update of each mode in the shared row format, ratio async / sync."""
    samples = {mode: Samples([r.loop_seconds / len(r.records) for r in rows[mode]],
                             [cpu / len(r.records) for r, cpu in zip(rows[mode], learner_cpu[mode])])
               for mode in ("async", "sync")}
    comparison = Comparison(samples, len(samples["sync"].walls), halves_agree(samples["async"], samples["sync"]),
                            *loaded, 0)  # threads 0: not shown; the learner's count is in the heading
    print(f"seconds per update: ratio {'' if comparison.settled else 'not '}settled between the earlier and the "
          f"later repeats{'; host loaded' if any(loaded) else ''}; CPU: the learner process's")
    print(row_header(8))
    for row in format_rows(comparison, baseline="sync", name_width=8):
        print(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lag", type=int, default=2, help="K of the asynchronous runs")
    parser.add_argument("--kernels", choices=("aligned", "standard"), default="aligned")
    parser.add_argument("--algo", choices=("reinforce_zero", "flash_reinforce"), default="reinforce_zero")
    parser.add_argument("--own-version-check", action="store_true")
    parser.add_argument("--one-thread", action="store_true",
                        help="also run every repeat with the learner at one torch thread (doubles the run time)")
    args = parser.parse_args()

    import torch

    from zero_mismatch_plugin.tools.demo import DemoConfig, DemoRun, run_demo
    from zero_mismatch_plugin.tools.demo.engine import start_engine
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    print(host_line("before"), flush=True)
    base = dict(algo=args.algo, kernels=args.kernels, own_version_check=args.own_version_check)

    def alternate_modes(engine, model_dir):
        """``--repeats`` rounds of a sync then an async run: their results, CPU shares, learner CPU s."""
        rows, shares, learner_cpu = ({"sync": [], "async": []} for _ in range(3))
        for repeat in range(args.repeats):
            for mode, lag in (("sync", 0), ("async", args.lag)):
                demo = DemoRun(DemoConfig(**base, lag=lag, updates=args.updates), engine, model_dir)
                with CpuMeter(engine.pid) as meter:  # the update loop only, not the learner's set-up
                    result = demo.run()
                rows[mode].append(result)
                shares[mode].append(meter.share)
                learner_cpu[mode].append(meter.learner_seconds)
                print(f"repeat {repeat + 1} {mode:<5} lag {lag}: {_rate(result):6.2f} updates/s  "
                      f"(cores: learner {meter.share.learner:.2f}, engine {meter.share.engine:.2f}, "
                      f"others {meter.share.others:.2f})", flush=True)
        return rows, shares, learner_cpu

    learner_threads = [torch.get_num_threads()] + ([1] if args.one_thread and torch.get_num_threads() != 1 else [])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", family="llama", seed=0)
        with start_engine(model_dir, DemoConfig().max_model_len) as engine:
            run_demo(DemoConfig(**base, lag=0, updates=5), engine, model_dir)  # warm-up
            for threads in learner_threads:
                print(f"learner torch threads {threads}:", flush=True)
                loaded_before = host_is_loaded()
                rows, shares, learner_cpu = at_threads(threads, alternate_modes, engine, model_dir)
                loaded = (loaded_before, host_is_loaded())
                print(f"\nlearner torch threads {threads}:")
                _print_table(args, DemoConfig(**base), rows, shares)
                _print_rows(rows, learner_cpu, loaded)
    print(host_line("after"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
