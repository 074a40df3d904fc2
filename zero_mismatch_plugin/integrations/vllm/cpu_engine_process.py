"""A CPU engine of one process: the model runs in vLLM's EngineCore, with no worker process.

With ``ZMRL_CPU_ENGINE_ONE_PROCESS=1`` (and ``OMP_NUM_THREADS=1``) a CPU engine of world size 1
keeps vLLM's ``uni`` executor, which the CPU platform otherwise replaces by the multiprocess one:
one spawned process (and its imports) fewer, about 10 s per engine start on 2 cores. For tests and
small checks: the model computes on one unbound thread.

With ``ZMRL_CPU_ENGINE_FORK=1`` as well, the EngineCore process is forked from a fork server that
imported vLLM once (:data:`ENGINE_FORK_SERVER_PRELOAD`), instead of spawned: it starts without
re-importing torch and vLLM, about 15 s sooner per start on 2 cores. Like a spawned process it
starts from nothing the caller did (patches, caches, process groups), with the caller's
environment at the start. An engine of several ranks (tensor parallelism) then forks its worker
processes from that EngineCore, as vLLM does on GPUs, instead of spawning each (one import of
torch and vLLM, ~10 s of a core, per rank), where every rank is bound to one CPU: a forked worker
keeps the OpenMP runtime of the process it came from, one thread, where a spawned one would read
the per-rank ``OMP_*`` variables vLLM sets for it.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.forkserver
import os

from zero_mismatch_plugin.integrations.vllm.patch_kinds import vllm_patch
from zero_mismatch_plugin.tables.switches import CPU_ENGINE_FORK, CPU_ENGINE_ONE_PROCESS, CPU_THREADS_BIND, enabled


def _keep_uniprocess_executor(original):
    check_and_update_config = original.__func__  # a classmethod

    def keep_uniprocess(cls, vllm_config):
        check_and_update_config(cls, vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.world_size == 1 and parallel.distributed_executor_backend == "mp":
            # vLLM's worker process runs with OMP_NUM_THREADS set for it; the EngineCore would run
            # vLLM's CPU kernels on every core, and some (CPU MLA decode) split work by thread.
            if os.environ.get("OMP_NUM_THREADS") != "1":
                raise RuntimeError(
                    f"{CPU_ENGINE_ONE_PROCESS}=1 runs the model in the EngineCore process and needs "
                    f"OMP_NUM_THREADS=1 there (found {os.environ.get('OMP_NUM_THREADS')!r}): set "
                    f"OMP_NUM_THREADS=1, or unset {CPU_ENGINE_ONE_PROCESS}")
            parallel.distributed_executor_backend = "uni"

    return classmethod(keep_uniprocess)


ONE_PROCESS = vllm_patch(
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config", _keep_uniprocess_executor,
    name="cpu-engine-one-process",
    why="vLLM's CPU platform starts a worker process even for world size 1; the uni executor runs "
        "the same worker in the EngineCore process and the engine starts one process import sooner",
    when=f"{CPU_ENGINE_ONE_PROCESS}=1",
)


# What the fork server imports once: the EngineCore, its one-process executor and the CPU worker,
# and the in-process engine of ``vllm.LLM`` (the demo's engine process runs one).
ENGINE_FORK_SERVER_PRELOAD = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
                              "vllm.entrypoints.llm")


# After the caller's death, how long an orphaned engine process has to shut down on SIGTERM before
# it is killed (vLLM's EngineCore stops its workers on SIGTERM).
ORPHAN_SHUTDOWN_S = 10.0


class _ProcessWithCallersEnvironment(multiprocessing.context.ForkServerProcess):
    """A fork-server process that runs with the caller's ``os.environ`` of ``start()``, as a spawned
    one would (a fork server's children otherwise get the server's environment), and ends when
    the caller does: its parent is the fork server, not the caller, so nothing else tells it that
    the caller is gone (a caller killed outright, e.g. a Ray actor at shutdown, left its EngineCore
    and the EngineCore's workers running, idle, holding their memory)."""

    def start(self):
        self._caller_environment = dict(os.environ)  # pickled to the server with the process
        self._caller_pid, self._orphan_shutdown_s = os.getpid(), ORPHAN_SHUTDOWN_S
        super().start()

    def run(self):
        os.environ.clear()
        os.environ.update(self._caller_environment)
        _end_with(self._caller_pid, self._orphan_shutdown_s)
        super().run()


def _end_with(caller_pid: int, shutdown_s: float) -> None:
    """Send this process SIGTERM when ``caller_pid`` exits, and SIGKILL if it is still running
    ``shutdown_s`` later (a daemon thread waiting on the caller's pidfd)."""
    import select
    import signal
    import threading
    import time

    try:
        caller = os.pidfd_open(caller_pid)
    except ProcessLookupError:  # gone already
        caller = None

    def watch():
        if caller is not None:
            select.select([caller], [], [])  # readable when the caller has exited
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(shutdown_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zmrl-end-with-caller", daemon=True).start()


class _EngineForkServerContext(multiprocessing.context.ForkServerContext):
    Process = _ProcessWithCallersEnvironment


_ENGINE_FORK_SERVER = _EngineForkServerContext()


def engine_fork_server() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes come from the engine fork server."""
    multiprocessing.forkserver.set_forkserver_preload(list(ENGINE_FORK_SERVER_PRELOAD))
    return _ENGINE_FORK_SERVER


def engine_process_context() -> multiprocessing.context.BaseContext:
    """For a process that runs a vLLM engine: the fork server with ``ZMRL_CPU_ENGINE_FORK=1``,
    else spawn."""
    return engine_fork_server() if enabled(CPU_ENGINE_FORK) else multiprocessing.get_context("spawn")


def _engine_cores_from_a_fork_server(original):
    def get_mp_context():
        context = original()
        return engine_fork_server() if context.get_start_method() == "spawn" else context

    return get_mp_context


FORK_SERVER = vllm_patch(
    "vllm.v1.engine.utils:get_mp_context", _engine_cores_from_a_fork_server,
    name="cpu-engine-fork-server",
    why="every spawned EngineCore imports torch and vLLM again; one fork server imports them once and "
        "forks each EngineCore from that clean state, with the caller's environment",
    when=f"{CPU_ENGINE_ONE_PROCESS}=1 and {CPU_ENGINE_FORK}=1",
)


def one_cpu_per_rank(binding: str | None) -> bool:
    """Whether ``VLLM_CPU_OMP_THREADS_BIND`` binds every rank to exactly one CPU (``"0|1"``)."""
    return bool(binding) and all(share.strip().isdigit() for share in binding.split("|"))


def _workers_forked_from_the_engine_core(original):
    def get_mp_context():
        context = original()
        if (context.get_start_method() == "spawn" and os.environ.get("OMP_NUM_THREADS") == "1"
                and one_cpu_per_rank(os.environ.get(CPU_THREADS_BIND))):
            return multiprocessing.get_context("fork")
        return context

    return get_mp_context


FORKED_WORKERS = vllm_patch(
    "vllm.v1.executor.multiproc_executor:get_mp_context", _workers_forked_from_the_engine_core,
    name="cpu-engine-forked-workers",
    why="vLLM's CPU platform spawns every worker of a multi-rank engine, each importing torch and vLLM "
        "again; with one one-thread CPU per rank, forking them from the EngineCore (vLLM's own start "
        "method on GPUs) runs the same workers on the same thread count",
    when=f"{CPU_ENGINE_ONE_PROCESS}=1, {CPU_ENGINE_FORK}=1, OMP_NUM_THREADS=1 and one CPU per rank in "
         f"{CPU_THREADS_BIND}",
)
