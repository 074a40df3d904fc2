"""Two-rank scripts of tests/support run as a user runs them (``python SCRIPT ...``): the ranks are
forked from the script's process over a gloo file store; each writes what it saw, or its traceback.

The fork-form tests of the CPU-platform patches use it (``megatron_cpu_training.py``,
``mbridge_cpu_loading.py``, with SUPPORT on the path as a script's own directory).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

SUPPORT = Path(__file__).resolve().parent


def bits_digest(named_tensors) -> str:
    """The names and bits of ``(name, tensor)`` pairs, in their order, as one digest."""
    digest = hashlib.sha256()
    for name, tensor in named_tensors:
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def ranks_saw(script: str, mode: str, patched: Path | str, out: Path, *args) -> list[dict | str]:
    """What each rank of ``support/<script>`` saw (its JSON, or its traceback)."""
    out.mkdir()
    path = SUPPORT / script
    done = subprocess.run([sys.executable, str(path), mode, str(patched), str(out), *map(str, args)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists()
            else (out / f"rank{r}.error").read_text() for r in range(2)]


def _rank(work, mode: str, rank: int, world: int, store: str, out: str, args: tuple) -> None:
    """One rank: a gloo process group, ``work(mode, world, out, *args)``, and what it returned (with
    whether the plugin was imported) in OUT/rank{r}.json, or its traceback in OUT/rank{r}.error."""
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        seen = work(mode, world, out, *args)
        seen["plugin_imported"] = "zero_mismatch_plugin" in sys.modules
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise


def start_ranks(work, world: int, mode: str, out: str, *args) -> None:
    """``work(mode, world, out, *args)`` on ``world`` forked ranks (:func:`_rank`; a gloo file store in a
    fresh directory); a rank still running after 300 s is killed."""
    store = os.path.join(tempfile.mkdtemp(), "store")
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank, args=(work, mode, rank, world, store, out, args)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(300)
        if process.is_alive():
            process.kill()
