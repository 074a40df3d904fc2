"""benchmarks/timing.py, the benchmarks' shared timing, on planted inputs: a fake clock, a planted
load average, recorded calls. No engines, no sleeping."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

TIMING_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "timing.py"


def _load_timing():
    spec = importlib.util.spec_from_file_location("benchmark_timing", TIMING_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


timing = _load_timing()


class FakeClock:
    """A (wall, CPU) clock that moves only when a contender advances it."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __call__(self):
        return self.wall, self.cpu

    def advance(self, wall: float, cpu: float | None = None) -> None:
        self.wall += wall
        self.cpu += wall if cpu is None else cpu


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


@pytest.fixture
def idle_host(monkeypatch):
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


@pytest.fixture
def loaded_host(monkeypatch):
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (_cpus() + 1.0, 0.5, 0.5))


def _steady_pair(clock: FakeClock):
    return {"a": lambda: clock.advance(0.010), "b": lambda: clock.advance(0.020)}


def test_loaded_host_is_flagged_in_host_line_and_rows(loaded_host):
    assert timing.host_is_loaded()
    assert "ratios unreliable: load above the cores" in timing.host_line("before")
    clock = FakeClock()
    comparison = timing.compare(_steady_pair(clock), repeats=4, warmup=0, clock=clock)
    assert comparison.settled and comparison.loaded_before and comparison.unreliable
    assert all(row.endswith(timing.UNRELIABLE) for row in timing.format_rows(comparison, baseline="b"))


def test_idle_host_is_not_flagged(idle_host):
    assert not timing.host_is_loaded()
    line = timing.host_line("after")
    assert "unreliable" not in line
    assert f"{_cpus()} CPUs usable" in line and f"torch threads {torch.get_num_threads()}" in line
    clock = FakeClock()
    comparison = timing.compare(_steady_pair(clock), repeats=4, warmup=0, clock=clock)
    assert not comparison.unreliable
    assert not any(timing.UNRELIABLE in row for row in timing.format_rows(comparison, baseline="b"))


def test_contenders_run_in_alternating_order(idle_host):
    calls = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    comparison = timing.compare(contenders, repeats=4, warmup=1, max_repeats=4)
    assert calls == ["a", "b", "c"] + ["a", "b", "c", "c", "b", "a"] * 2
    assert comparison.rounds == 4 and all(len(s.walls) == 4 for s in comparison.samples.values())


def test_one_thread_helper_sets_one_thread_and_restores():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert timing.at_one_thread(torch.get_num_threads) == 1
        assert torch.get_num_threads() == 2

        def failing():
            assert torch.get_num_threads() == 1
            raise RuntimeError("planted")

        with pytest.raises(RuntimeError, match="planted"):
            timing.at_one_thread(failing)
        assert torch.get_num_threads() == 2
        assert timing.thread_counts(None) == [2, 1]
    finally:
        torch.set_num_threads(previous)


def test_repeat_until_stable_stops_early_on_constant_samples(idle_host):
    clock = FakeClock()
    comparison = timing.compare(_steady_pair(clock), repeats=4, warmup=0, max_repeats=40, clock=clock)
    assert comparison.settled and comparison.rounds == 4
    assert "ratio settled" in comparison.line()


def test_repeat_until_stable_reports_drifting_samples_as_not_settled(idle_host):
    clock = FakeClock()
    b_calls = []

    def slower_each_call():
        b_calls.append(None)
        clock.advance(0.010 * 1.1 ** len(b_calls))

    comparison = timing.compare({"a": lambda: clock.advance(0.010), "b": slower_each_call}, repeats=4, warmup=0,
                                max_repeats=40, clock=clock)
    assert not comparison.settled and comparison.rounds == 40 and comparison.unreliable
    assert "not settled" in comparison.line()
    assert timing.format_rows(comparison)[0].endswith(timing.UNRELIABLE)


def test_halves_agree_on_precomputed_samples():
    steady = timing.Samples([1.0, 1.1, 0.9, 1.0], [0.0] * 4)
    assert timing.halves_agree(steady, timing.Samples([2.0, 2.2, 1.8, 2.0], [0.0] * 4))
    assert not timing.halves_agree(steady, timing.Samples([2.0, 2.2, 1.0, 1.1], [0.0] * 4))
    # one round per half is no evidence of a settled ratio
    assert not timing.halves_agree(timing.Samples([1.0, 1.0], []), timing.Samples([2.0, 2.0], []))


def test_cpu_time_is_reported_beside_wall_time(idle_host):
    clock = FakeClock()
    assert timing.timed(lambda: clock.advance(0.5, cpu=0.2), clock)[:2] == (0.5, 0.2)
    comparison = timing.compare({"waits": lambda: clock.advance(0.010, cpu=0.004),
                                 "computes": lambda: clock.advance(0.020, cpu=0.040)},
                                repeats=3, warmup=0, clock=clock)
    waits = comparison.samples["waits"]
    assert waits.cpu.median == pytest.approx(0.004) and waits.wall.median == pytest.approx(0.010)
    header, row = timing.row_header(), timing.format_rows(comparison, baseline="computes")[0]
    assert "CPU ms" in header
    # min ms, median ms, spread, CPU ms, ratio of minima, ratio of medians
    assert row.split()[1:] == ["10.00", "10.00", "0.0%", "4.00", "0.500x", "0.500x"]


def test_samples_of_several_calls_are_reported_per_call(idle_host):
    clock = FakeClock()
    calls = 8
    comparison = timing.compare({"a": lambda: [clock.advance(0.010, cpu=0.020) for _ in range(calls)],
                                 "b": lambda: [clock.advance(0.020) for _ in range(calls)]},
                                repeats=3, warmup=0, clock=clock)
    per_call = timing.per_call(comparison, calls)
    a, b = per_call.samples["a"], per_call.samples["b"]
    assert a.wall.median == pytest.approx(0.010) and a.cpu.median == pytest.approx(0.020)
    assert b.wall.minimum == pytest.approx(0.020)
    assert timing.format_rows(per_call, baseline="b")[0].split()[-2:] == ["0.500x", "0.500x"]
