"""Run a script of tests/support on one-thread torchrun ranks, as the multi-process tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent


def run_ranks(script: str, ranks: int, *args, timeout_s: float = 600) -> None:
    """``torchrun --standalone --nproc-per-node=ranks tests/support/<script> args...``, each rank on
    one thread and able to import ``support``; fails the test with the ranks' last output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           str(SUPPORT / script), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"{script} on {ranks} ranks exited {done.returncode}:\n" \
                                 f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
