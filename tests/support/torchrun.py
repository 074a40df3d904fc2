"""Run a script of tests/support on one-thread torchrun ranks, as the multi-process tests do.

The launcher is the package's (``rank_group.run_forked_ranks``: torch's elastic agent as ``torchrun
--standalone`` runs it) on the script's ``main``, with the ranks forked from a fork server that has
imported the script and its ``PRELOAD`` (the heavy modules ``main`` imports): each rank would
otherwise spend several seconds of a core importing them.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent


def run_ranks(script: str, ranks: int, *args, timeout_s: float = 600) -> None:
    """``main(*args)`` of ``tests/support/<script>`` on ``ranks`` one-thread ranks, each able to import
    ``support``; fails the test with the ranks' last output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT.parent), os.environ.get("PYTHONPATH", "")])}
    module = f"support.{Path(script).stem}"
    done = subprocess.run([sys.executable, "-m", "support.torchrun", module, str(ranks), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{script} on {ranks} ranks exited {done.returncode}:\n" \
                                 f"{done.stdout[-3000:]}{done.stderr[-3000:]}"


def launch(module_name: str, ranks: int, *args: str) -> int:
    """The launcher process: ``module_name.main(*args)`` on ``ranks`` forked ranks."""
    from zero_mismatch_plugin.integrations.megatron.rank_group import run_forked_ranks

    module = importlib.import_module(module_name)
    return run_forked_ranks(module.main, ranks, args, [module_name, *getattr(module, "PRELOAD", ())])


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1], int(sys.argv[2]), *sys.argv[3:]))
