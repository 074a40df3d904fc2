"""Side-by-side timings that hold on a shared machine (stdlib and torch only).

On a 2-core host shared with other work the same comparison printed 0.53x and 2.2x: OpenMP threads
that find their cores taken spin and wait, so a multi-threaded run can slow down a hundredfold while
a one-thread run barely moves. Hence, for every comparison:

* the host's load before and after (a ratio taken while the load exceeds the cores is flagged);
* contenders timed in alternating order, so both see the same load;
* the minimum (the least-disturbed run) beside the median and the spread of the samples;
* this process's CPU time beside wall time (CPU far below wall: the call waited for cores);
* repeats until the ratio settles (up to a cap), and whether it did;
* the same comparison at one torch thread, which load disturbs least.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

UNRELIABLE = "UNRELIABLE"


def host_is_loaded() -> bool:
    """Whether the 1-minute load average exceeds the CPUs this process may use: other processes
    then hold cores the timed code's threads wait for, and its figures say more about them."""
    return os.getloadavg()[0] > len(os.sched_getaffinity(0))


def host_line(when: str) -> str:
    """The host's state at ``when``: load averages, usable CPUs, torch threads and ISA (torch's
    kernels differ by ISA, so the figures depend on it), and a warning when the host is loaded."""
    load = os.getloadavg()
    note = "; ratios unreliable: load above the cores" if host_is_loaded() else ""
    return (f"host {when}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
            f"{len(os.sched_getaffinity(0))} CPUs usable, torch threads {torch.get_num_threads()}, "
            f"ISA {torch.backends.cpu.get_cpu_capability()}{note}")


def process_clock() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads), now."""
    return time.perf_counter(), time.process_time()


def timed(fn: Callable, clock: Callable[[], tuple[float, float]] = process_clock):
    """(wall seconds, this process's CPU seconds, result) of one call of ``fn``. CPU above wall: the
    call ran on several threads; CPU well below wall: it waited (I/O, another process, taken cores)."""
    wall, cpu = clock()
    result = fn()
    wall_end, cpu_end = clock()
    return wall_end - wall, cpu_end - cpu, result


@dataclass(frozen=True)
class Stats:
    """Minimum (the least-disturbed run), median, and spread: (p75 - p25) / median."""

    minimum: float
    median: float
    spread: float

    @classmethod
    def of(cls, values: list[float]) -> "Stats":
        median = statistics.median(values)
        if len(values) < 2 or median == 0:
            return cls(min(values), median, 0.0)
        p25, _, p75 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(min(values), median, (p75 - p25) / median)


@dataclass
class Samples:
    """One contender's timings, one entry per call: wall seconds and this process's CPU seconds."""

    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)

    def add(self, wall: float, cpu: float) -> None:
        self.walls.append(wall)
        self.cpus.append(cpu)

    @property
    def wall(self) -> Stats:
        return Stats.of(self.walls)

    @property
    def cpu(self) -> Stats:
        return Stats.of(self.cpus)


@dataclass
class Comparison:
    """The samples of every contender, and what makes their ratios trustworthy or not."""

    samples: dict[str, Samples]
    rounds: int
    settled: bool
    loaded_before: bool
    loaded_after: bool
    threads: int

    @property
    def unreliable(self) -> bool:
        return self.loaded_before or self.loaded_after or not self.settled

    def line(self) -> str:
        """How the samples were taken: rounds, threads, whether the ratio settled, the load."""
        load = " and ".join(w for w, on in (("before", self.loaded_before), ("after", self.loaded_after)) if on)
        return (f"{self.rounds} alternating rounds at {self.threads} torch thread(s), ratio "
                f"{'' if self.settled else 'not '}settled" + (f"; host loaded {load}" if load else ""))


def halves_agree(first: Samples, second: Samples, tolerance: float = 0.03) -> bool:
    """Whether the median of the per-round ratios first/second over the earlier half of the rounds
    and over the later half agree within ``tolerance``: a ratio that still drifts has not settled.
    Per-round ratios pair calls made close in time, so load common to both cancels out. Fewer than
    two rounds per half never count as settled: one ratio against another says nothing of a trend."""
    ratios = [a / max(b, 1e-12) for a, b in zip(first.walls, second.walls)]
    half = len(ratios) // 2
    if half < 2:
        return False
    early, late = statistics.median(ratios[:half]), statistics.median(ratios[-half:])
    return abs(late / max(early, 1e-12) - 1) <= tolerance


def compare(contenders: dict[str, Callable], repeats: int = 7, warmup: int = 1, max_repeats: int | None = None,
            tolerance: float = 0.03, setup: dict[str, Callable] | None = None,
            clock: Callable[[], tuple[float, float]] = process_clock,
            agree: Callable[[bool], bool] | None = None) -> Comparison:
    """Time the contenders side by side: ``warmup`` untimed calls each, then rounds of one timed call
    each, in alternating order (A B, B A, ...) so that neither always runs first and both see the
    same load. After ``repeats`` rounds, keep going until every contender's ratio to the first one
    settles (:func:`halves_agree`) or ``max_repeats`` rounds (default 3 x ``repeats``) are done.
    ``setup[name]``, if given, runs untimed before each of that contender's calls. ``agree``, if
    given, turns this process's "settled" into one every cooperating process shares (distributed
    ranks must stop after the same round)."""
    prepare = {name: (setup or {}).get(name, lambda: None) for name in contenders}
    loaded_before = host_is_loaded()
    for _ in range(warmup):
        for name, fn in contenders.items():
            prepare[name]()
            fn()
    samples = {name: Samples() for name in contenders}
    order = list(contenders.items())
    cap = max(repeats, max_repeats if max_repeats is not None else 3 * repeats)
    first, *others = samples.values()
    rounds, settled = 0, False
    while rounds < cap:
        for name, fn in order if rounds % 2 == 0 else order[::-1]:
            prepare[name]()
            wall, cpu, _ = timed(fn, clock)
            samples[name].add(wall, cpu)
        rounds += 1
        settled = all(halves_agree(first, other, tolerance) for other in others)
        if agree is not None:
            settled = agree(settled)
        if rounds >= repeats and settled:
            break
    return Comparison(samples, rounds, settled, loaded_before, host_is_loaded(), torch.get_num_threads())


def per_call(comparison: Comparison, calls: int) -> Comparison:
    """``comparison`` whose every sample timed ``calls`` calls in a row, as times per call."""
    for samples in comparison.samples.values():
        samples.walls[:] = [wall / calls for wall in samples.walls]
        samples.cpus[:] = [cpu / calls for cpu in samples.cpus]
    return comparison


def at_threads(threads: int, measure: Callable, *args, **kwargs):
    """``measure(*args, **kwargs)`` with torch at ``threads`` threads; the previous count restored
    afterwards, also when it raises."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure(*args, **kwargs)
    finally:
        torch.set_num_threads(previous)


def at_one_thread(measure: Callable, *args, **kwargs):
    """``measure`` at one torch thread: no OpenMP thread waits for a core another process holds."""
    return at_threads(1, measure, *args, **kwargs)


def add_timing_arguments(parser) -> None:
    """The options every benchmark takes for the thread variants and the repeat cap."""
    parser.add_argument("--max-repeats", type=int, default=None,
                        help="cap on the rounds while the ratio has not settled (default 3 x the repeats)")
    variants = parser.add_mutually_exclusive_group()
    variants.add_argument("--skip-one-thread", action="store_true", help="only the default torch thread count")
    variants.add_argument("--one-thread-only", action="store_true", help="only one torch thread")


def thread_counts(args) -> list[int]:
    """The torch thread counts to measure at: the current one, then one (once, if they are equal)."""
    current = torch.get_num_threads()
    if getattr(args, "one_thread_only", False):
        return [1]
    if getattr(args, "skip_one_thread", False) or current == 1:
        return [current]
    return [current, 1]


def row_header(name_width: int = 40) -> str:
    return (f"{'':<{name_width}}{'min ms':>10}{'median ms':>11}{'spread':>8}{'CPU ms':>10}"
            f"{'ratio min':>10}{'ratio med':>10}")


def format_row(name: str, samples: Samples, baseline: Samples | None = None, unreliable: bool = False,
               name_width: int = 40) -> str:
    """One contender under :func:`row_header`: minimum and median wall ms, spread, median CPU ms
    ("-" when not measured), its ratio to ``baseline`` of the minima and of the medians, and the
    flag UNRELIABLE when the host was loaded or the ratio did not settle."""
    wall = samples.wall
    spread = f"{wall.spread:.1%}" if wall.spread < 10 else f"{wall.spread:.0%}"  # stays inside its column
    cpu = f"{samples.cpu.median * 1e3:>10.2f}" if samples.cpus else f"{'-':>10}"
    ratios = "" if baseline is None else (f"{wall.minimum / baseline.wall.minimum:>9.3f}x"
                                          f"{wall.median / baseline.wall.median:>9.3f}x")
    return (f"{name:<{name_width}}{wall.minimum * 1e3:>10.2f}{wall.median * 1e3:>11.2f}{spread:>8}"
            f"{cpu}{ratios}" + (f"  {UNRELIABLE}" if unreliable else ""))


def format_rows(comparison: Comparison, baseline: str | None = None, name_width: int = 40) -> list[str]:
    """Every contender of ``comparison`` as a row, ratios against ``baseline`` (default: the last)."""
    reference = comparison.samples[baseline or list(comparison.samples)[-1]]
    return [format_row(name, samples, reference, comparison.unreliable, name_width)
            for name, samples in comparison.samples.items()]


def print_by_threads(by_threads: dict[int, dict[str, Comparison]], baseline: str, name_width: int = 14) -> None:
    """Print each phase's comparison at each thread count (``{threads: {phase: Comparison}}``, as a
    benchmark measures it over :func:`thread_counts`), ratios against ``baseline``."""
    for threads, phases in by_threads.items():
        for what, comparison in phases.items():
            print(f"  {what}, torch threads {threads}: {comparison.line()}")
            print("  " + row_header(name_width))
            for row in format_rows(comparison, baseline=baseline, name_width=name_width):
                print(f"  {row}")
