"""A CPU engine of one process: the model runs in vLLM's EngineCore, with no worker process.

With ``ZMRL_CPU_ENGINE_ONE_PROCESS=1`` (and ``OMP_NUM_THREADS=1``) a CPU engine of world size 1
keeps vLLM's ``uni`` executor, which the CPU platform otherwise replaces by the multiprocess one:
one spawned process (and its imports) fewer, about 10 s per engine start on 2 cores. For tests and
small checks: the model computes on one unbound thread.
"""

from __future__ import annotations

import os

from zero_mismatch_plugin.integrations.vllm.patch_kinds import vllm_patch
from zero_mismatch_plugin.tables.switches import CPU_ENGINE_ONE_PROCESS


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
