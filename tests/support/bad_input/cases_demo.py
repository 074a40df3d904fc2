"""Bad command lines of ``zmrl demo`` beyond the option values in ``cases_cli``: output directories
another run holds, conversations this host cannot keep bitwise, adapters vLLM cannot serve.

Every case is refused with a message that says what to change, before any work: ``refused`` makes
every engine and model start raise.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.bad_input import error
from support.bad_input.cases_cli import demo

LOCK = ".zmrl-demo.lock"


@functools.cache
def _workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="zmrl-bad-demo-"))


def _directory(name: str, **files: str) -> str:
    """A directory under the work dir holding ``files`` (name -> text); dots spelt as underscores."""
    path = _workdir() / name
    path.mkdir(exist_ok=True)
    for file, text in files.items():
        (path / file.replace("_", ".")).write_text(text)
    return str(path)


def in_progress() -> str:
    """An output directory a running demo (this process, alive) holds the lock of."""
    path = Path(_directory("in-progress"))
    (path / LOCK).write_text(f"{os.getpid()}\n")
    return str(path)


def left_by_a_killed_run() -> str:
    """A lock whose process is gone (a demo killed with SIGKILL leaves its lock)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = Path(_directory("stale-lock", metrics_jsonl='{"step": 1, "data": {}}\n'))
    (path / LOCK).write_text(child.stdout)
    return str(path)


def finished_run() -> str:
    return _directory("finished", metrics_jsonl='{"step": 1, "data": {}}\n', summary_json="{}", report_txt="report\n")


def interrupted_run() -> str:
    return _directory("interrupted", metrics_jsonl='{"step": 1, "data": {}}\n')


def _bitwise_turns():
    """(--turns one past what this host keeps bitwise, its tokens, the bound) or None where no
    such --turns fits the model (a large L2 cache) or the bound is unknown (not the VEC kernel)."""
    from zero_mismatch_plugin.tools.demo.runner import DemoConfig, conversation_tokens, demo_bitwise_context_tokens
    from zero_mismatch_plugin.tools.tiny_models import DEFAULT_SHAPE

    bound = demo_bitwise_context_tokens()
    if bound is None:
        return None
    turns = bound // conversation_tokens(1, DemoConfig.response_tokens) + 1
    needed = conversation_tokens(turns, DemoConfig.response_tokens)
    if needed > DEFAULT_SHAPE["max_position_embeddings"]:
        return None
    return turns, needed, bound


_PAST_BITWISE = _bitwise_turns()
_NO_BOUND = pytest.mark.skipif(_PAST_BITWISE is None, reason="every --turns the model fits stays bitwise on this host")
_TURNS, _TOKENS, _BOUND = _PAST_BITWISE or (0, 0, 0)


def _largest_served_rank() -> int:
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return max(get_args(MaxLoRARanks))


CASES = [
    # ----- output directories -----------------------------------------------------------------
    error("demo-out-in-use-by-a-running-demo", lambda: demo("--out", in_progress())(),
          r"--out .*in-progress is in use by a zmrl demo \(pid \d+\) \(lock file .*in-progress/\.zmrl-demo\.lock\); "
          r"choose another directory with --out"),
    error("demo-out-locked-by-a-killed-demo", lambda: demo("--out", left_by_a_killed_run())(),
          r"--out .*stale-lock is in use by a zmrl demo \(pid \d+, no longer running: it was killed before it "
          r"could remove the lock\) \(lock file .*\.zmrl-demo\.lock\); choose another directory with --out"),
    error("demo-out-holds-a-finished-run", lambda: demo("--out", finished_run())(),
          r"--out .*finished holds another zmrl demo run's outputs \(metrics\.jsonl, summary\.json, report\.txt\); "
          r"choose another directory with --out"),
    error("demo-out-holds-an-interrupted-run", lambda: demo("--out", interrupted_run())(),
          r"--out .*interrupted holds another zmrl demo run's outputs \(metrics\.jsonl\); "
          r"choose another directory with --out"),
    error("compare-out-holds-a-finished-run", lambda: demo("--compare", "--out", finished_run())(),
          r"--out .*finished holds another zmrl demo run's outputs"),
    # ----- what the aligned kernels cannot keep bitwise on this host -------------------------------
    error("demo-turns-past-the-hosts-bitwise-length",
          lambda: demo("--turns", str(_TURNS), "--out", str(_workdir() / "turns"))(),
          rf"--turns {_TURNS}: a conversation reaches {_TOKENS} tokens, more than the {_BOUND} tokens this host's "
          rf"vLLM CPU attention keeps bitwise between the engine and the aligned learner .*; "
          rf"use at most {_BOUND // 28} turns",
          marks=(_NO_BOUND,)),
    error("demo-turns-past-the-bitwise-length-with-lora",
          lambda: demo("--turns", str(_TURNS), "--lora", "8", "--out", str(_workdir() / "turns-lora"))(),
          rf"--turns {_TURNS}: .* keeps bitwise", marks=(_NO_BOUND,)),
    # ----- LoRA ------------------------------------------------------------------------------------
    error("demo-lora-rank-vllm-cannot-serve",
          lambda: demo("--lora", str(_largest_served_rank() * 2), "--out", str(_workdir() / "lora"))(),
          r"--lora \d+: rank \d+ exceeds vLLM's largest max_lora_rank \d+; choose a smaller rank"),
    error("demo-lora-with-moe", demo("--model", "moe", "--lora", "8"),
          r"--lora trains the dense linears; vLLM has no CPU LoRA path for MoE experts"),
]
