"""A torchrun group of Megatron-face ranks that serves calls from the process that started it.

The parent (:class:`RankGroup`) starts torchrun's launcher (:func:`start_ranks`: torch's elastic
agent, as ``torchrun --standalone`` runs it) on :func:`serve`; rank 0 connects back over an
authenticated local socket, receives each call, broadcasts it to the other ranks, and returns its
result (every rank computes it; the logprobs are whole on each). A rank that dies is found by
the agent, which stops the others; the parent then raises :class:`RankFailure` naming the rank and
its exit (or, if the launcher itself hangs, after the collective timeout plus a margin).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from pathlib import Path

import torch

from zero_mismatch_plugin.integrations.megatron.distributed import (
    COLLECTIVE_TIMEOUT_S, RANK_CALLS, Layout, ScoreRequest, init_ranks)

# How long the ranks may take to start (import vLLM and megatron-core, build the process group).
START_TIMEOUT_S = 300.0
# What a rank imports before its first answer: ~8 s of a core per rank, measured with
# PYTHONPROFILEIMPORTTIME on a Llama rank (megatron.core 3.1 s, vLLM's engine arguments 2.3 s, its
# executors 0.7 s). The launcher's fork server imports them once and every rank is forked from it,
# so a group of N ranks pays them once instead of N times. Only third-party modules: the package's
# own are imported by each rank, after the launcher's environment is set.
RANK_PRELOAD = ("megatron.core", "megatron.core.models.gpt.gpt_layer_specs", "vllm.engine.arg_utils",
                "vllm.v1.executor", "vllm.model_executor.layers.attention", "vllm.model_executor.layers.linear",
                "vllm.model_executor.layers.fused_moe")
STOP = "stop"
# Seconds torchrun gets, after a rank failed, to stop the others and print its summary.
TORCHRUN_GRACE_S = 20.0
# How long idle ranks wait for the next call.
IDLE_DAYS = 7
# How long a rank whose collective failed (another rank died) waits before it exits; the launcher
# checks its ranks every 0.1 s.
PEER_LOSS_EXIT_DELAY_S = 3.0


class RankFailure(RuntimeError):
    """A rank of the group died, failed, or the group stopped answering."""


# Plain pickle, not the connection's own: torch registers reducers there that pass tensors as
# file descriptors of this process's shared memory, which a process torchrun started cannot open.
def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failed_rank(log: str) -> str | None:
    """'rank N (<how it exited>)' from torchrun's failure summary, if it printed one."""
    root = log.rfind("Root Cause")
    if root < 0:
        return None
    rank = re.search(r"rank\s*:\s*(\d+)", log[root:])
    code = re.search(r"exitcode\s*:\s*(-?\d+)", log[root:])
    if rank is None or code is None:
        return None
    return f"rank {rank.group(1)} ({_exit_words(int(code.group(1)))})"


class RankGroup:
    """``with RankGroup(layout) as group: group.call("token_logprobs", model, batch)``."""

    def __init__(self, layout: Layout, timeout_s: float = COLLECTIVE_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S):
        self.layout = layout
        self.timeout_s = timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="zmrl-ranks-")
        self.log_path = Path(self._dir.name) / "ranks.log"
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        # The handshake key goes through a file only this user can read (the directory is 0700),
        # not the environment, which every rank and its children would inherit.
        key_path = Path(self._dir.name) / "handshake.key"
        key_path.write_bytes(key)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", __name__, f"{host}:{port}", str(key_path),
                   json.dumps(dataclasses.asdict(layout)), repr(timeout_s)]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self._conn = None
        try:
            self._conn = self._accept(start_timeout_s)
            self.rank_pids = _recv(self._conn)
        except BaseException:
            self.close()
            raise

    def _accept(self, timeout_s: float):
        accepted = []
        thread = threading.Thread(target=lambda: accepted.append(self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.5)
            if self.process.poll() is not None:
                raise self._failure("the ranks exited while starting")
            if time.monotonic() > deadline:
                raise self._failure(f"rank 0 did not connect within {timeout_s:.0f} s")
        return accepted[0]

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def _failure(self, what: str) -> RankFailure:
        try:
            # torchrun stops the other ranks itself and then prints which rank failed and how.
            self.process.wait(TORCHRUN_GRACE_S)
        except subprocess.TimeoutExpired:
            self._stop_process()
        log = self.log_path.read_text(errors="replace")
        rank = failed_rank(log)
        cause = f"{rank} failed first" if rank else f"torchrun exited with {_exit_words(self.process.returncode)}"
        return RankFailure(f"Megatron-face ranks ({self.layout.name}): {what}; {cause}. Last lines of the ranks' log "
                           f"({self.log_path}):\n{log[-4000:]}")

    def call(self, name: str, *args):
        """Run ``RANK_CALLS[name](*args)`` on every rank (or ``name`` a ``"module:function"`` of
        this package, :func:`rank_call`); rank 0's result."""
        if self._conn is None:
            raise RankFailure("the rank group is closed")
        try:
            _send(self._conn, (name, args))
        except (OSError, EOFError):
            raise self._failure(f"{name}: rank 0 is gone") from None
        # A live group answers or fails within the collective timeout; torchrun needs a moment more.
        deadline = time.monotonic() + self.timeout_s + 30.0
        while not self._conn.poll(0.5):
            if self.process.poll() is not None:
                raise self._failure(f"{name}: a rank died")
            if time.monotonic() > deadline:
                raise self._failure(f"{name}: no answer within {self.timeout_s + 30.0:.0f} s")
        try:
            ok, value = _recv(self._conn)
        except (OSError, EOFError):
            raise self._failure(f"{name}: rank 0 is gone") from None
        if not ok:
            raise RankFailure(f"Megatron-face ranks ({self.layout.name}): {name} failed:\n{value}")
        return value

    def _stop_process(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def close(self) -> None:
        if self._conn is not None:
            try:
                _send(self._conn, (STOP, ()))
                self.process.wait(30)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                pass
            self._conn.close()
            self._conn = None
        if self.process.poll() is None:
            self._stop_process()
        self._listener.close()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self._dir.cleanup()


def rank_call(name: str):
    """What a call named ``name`` runs: an entry of ``RANK_CALLS``, or a ``"module:function"`` of
    this package (a tool's own rank function, e.g. the bisector's records), imported on the ranks."""
    if name in RANK_CALLS:
        return RANK_CALLS[name]
    module, _, attr = name.partition(":")
    if not attr or not module.startswith("zero_mismatch_plugin."):
        raise ValueError(f"unknown rank call {name!r}: use one of {sorted(RANK_CALLS)} or a 'module:function' of "
                         "zero_mismatch_plugin")
    return getattr(importlib.import_module(module), attr)


def _answer_calls(conn, rank: int, calls) -> None:
    """Run the parent's calls (rank 0 receives each and broadcasts it) until it says stop."""
    import torch.distributed as dist

    while True:
        message = [_recv(conn) if rank == 0 else None]
        dist.broadcast_object_list(message, src=0, group=calls)
        name, args = message[0]
        if name == STOP:
            break
        try:
            outcome = (True, rank_call(name)(*args))
        except Exception:  # noqa: BLE001 - reported to the parent, the group stays up
            outcome = (False, f"rank {rank}: {traceback.format_exc()}")
            # Also in the ranks' log: a rank still waiting on this one's send or receive (a pipeline
            # stage) fails by its timeout before the outcomes meet, and the log is then all there is.
            print(outcome[1], file=sys.stderr, flush=True)
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (outcome[0], None if outcome[0] else outcome[1]))
        errors = [text for ok, text in outcomes if not ok]
        if rank == 0:
            _send(conn, outcome if not errors else (False, "\n".join(errors)))


def serve(address: str, key_path: str, layout: Layout, timeout_s: float) -> int:
    """One rank: set up the process group, then run the parent's calls until it says stop."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_ranks(layout, timeout_s)
    rank = dist.get_rank()
    # Between calls the ranks wait for the parent's next one as long as it takes: the calls are
    # broadcast in a group of their own, without the collective timeout (a dead rank still fails
    # it at once: its connections reset).
    calls = dist.new_group(backend="gloo", timeout=timedelta(days=IDLE_DAYS))
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    conn = None
    if rank == 0:
        host, port = address.rsplit(":", 1)
        conn = Client((host, int(port)), authkey=Path(key_path).read_bytes())
        _send(conn, pids)
    try:
        _answer_calls(conn, rank, calls)
    except Exception:
        # A collective of the loop failed: another rank is gone. Leave after it by a margin, so that
        # the launcher, which reports the first rank it finds dead, names the one that died first.
        time.sleep(PEER_LOSS_EXIT_DELAY_S)
        raise
    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch(requests: list[ScoreRequest], layouts: list[Layout], group=None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> list[dict]:
    """Score every request at each layout on one rank group (``group``, else one started for the
    call; the layouts share its world size); returns, per request, {layout name:
    :func:`run_request`'s result}."""
    sizes = {layout.world_size for layout in layouts}
    if len(sizes) != 1 or (group is not None and sizes != {group.layout.world_size}):
        raise ValueError(f"one launch runs layouts of one world size, that of its rank group; got {sorted(sizes)}")
    if group is None:
        with RankGroup(layouts[0], timeout_s=timeout_s) as own:
            return launch(requests, layouts, own)
    return [{layout.name: group.call("run_request", request, layout) for layout in layouts} for request in requests]


def run_forked_ranks(entrypoint, world_size: int, args: tuple, preload) -> int:
    """torch's elastic agent as ``torchrun --standalone`` runs it (c10d rendezvous on localhost, no
    restarts) on ``entrypoint(*args)``, ``world_size`` ranks forked from a fork server that has
    imported ``preload``; 0, or 1 with the failed rank's summary (torchrun's "Root Cause" report) on
    stderr. Call it once per process (the fork server and its preload are the process's)."""
    import multiprocessing
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    multiprocessing.set_forkserver_preload(list(preload))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          start_method="forkserver")
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as failure:
        print(failure, file=sys.stderr, flush=True)
        return 1
    return 0


def start_ranks(address: str, key_path: str, layout: Layout, timeout_s: float) -> int:
    """The launcher of a :class:`RankGroup`: ``layout.world_size`` ranks running :func:`serve`."""
    return run_forked_ranks(serve, layout.world_size, (address, key_path, layout, timeout_s), RANK_PRELOAD)


if __name__ == "__main__":
    # serve by the package module's name, not __main__'s: the ranks unpickle it in the fork server.
    from zero_mismatch_plugin.integrations.megatron.rank_group import start_ranks as package_start_ranks

    address, key_file, layout_fields, timeout = sys.argv[1:5]
    sys.exit(package_start_ranks(address, key_file, Layout(**json.loads(layout_fields)), float(timeout)))
