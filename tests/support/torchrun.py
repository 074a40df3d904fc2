"""Run a script of tests/support on one-thread torchrun ranks, as the multi-process tests do.

The launcher is torch's elastic agent as ``torchrun --standalone`` runs it, on the script's
``main``, with the ranks forked from a fork server that has imported the script and its
``PRELOAD`` (the heavy modules ``main`` imports): each rank would otherwise spend several seconds
of a core importing them, as the package's Megatron rank groups would (rank_group.RANK_PRELOAD).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import uuid
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
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    module = importlib.import_module(module_name)
    multiprocessing.set_forkserver_preload([module_name, *getattr(module, "PRELOAD", ())])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          start_method="forkserver")
    try:
        elastic_launch(config, module.main)(*args)
    except ChildFailedError as failure:
        print(failure, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1], int(sys.argv[2]), *sys.argv[3:]))
