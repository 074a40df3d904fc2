"""The Megatron face on megatron-core's own parallelism: one process per rank, started by torchrun.

:func:`launch` starts ``torchrun`` on :func:`main` with a job file (checkpoint, engine arguments,
prompt+response pairs, the layouts to score them at) and returns what rank 0 wrote: each
layout's per-sequence logprobs, the same tensors :class:`.standalone.MegatronScorer` returns in
one process. Collectives run over gloo on CPU with a timeout, so a rank that dies makes the
others fail instead of waiting (torchrun then stops the group).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

# Seconds a collective waits for a rank before it fails (torch.distributed's default is 30 min).
COLLECTIVE_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Layout:
    """A megatron-core parallel layout (megatron's names)."""

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def name(self) -> str:
        return f"tp{self.tensor_model_parallel_size}" + ("-sp" if self.sequence_parallel else "")

    def engine_kwargs(self) -> dict:
        """The engine arguments of the rollout this layout is bitwise with."""
        return {"tensor_parallel_size": self.tensor_model_parallel_size}

    def config_overrides(self) -> dict:
        return {"tensor_model_parallel_size": self.tensor_model_parallel_size,
                "sequence_parallel": self.sequence_parallel}


def init_ranks(layout: Layout, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """The process group (torchrun's environment) and megatron's model-parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != layout.world_size:
        raise ValueError(f"layout {layout.name} needs {layout.world_size} ranks, torchrun started {world}")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tensor_model_parallel_size)


def score(model_dir, engine_kwargs: dict, layout: Layout, prompts, responses, dtype: str = "float32"):
    """This rank's view of the aligned model's logprobs of ``responses`` (full on every rank)."""
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.integrations.megatron.standalone import (
        build_gpt_model,
        packed_logits,
        token_logprobs_from_logits,
    )

    runtime = VllmRuntime(model_dir, dtype=dtype, **{**engine_kwargs, **layout.engine_kwargs()})
    model = build_gpt_model(runtime, aligned=True, **layout.config_overrides())
    batch = pack(prompts, responses)
    multiple = layout.tensor_model_parallel_size if layout.sequence_parallel else 1
    with torch.no_grad():
        logits = packed_logits(model, batch, tokens_multiple_of=multiple)
        values = token_logprobs_from_logits(logits, batch)
    return batch.split_per_sequence(values.cpu())


@dataclasses.dataclass
class ScoreRequest:
    """Prompt+response pairs of one checkpoint to score, with the engine arguments of their rollout
    (the layout adds its own, e.g. ``tensor_parallel_size``)."""

    model_dir: str
    engine_kwargs: dict
    prompts: list
    responses: list


def main(argv=None) -> int:
    """One rank of a job written by :func:`launch` (``python -m ... JOB OUT``)."""
    import torch.distributed as dist

    job_path, out_path = (argv or sys.argv[1:])[:2]
    job = torch.load(job_path, weights_only=False)
    torch.set_num_threads(1)
    init_ranks(job["layouts"][0], job["timeout_s"])
    results = []
    for request in job["requests"]:
        results.append({
            layout.name: score(request.model_dir, request.engine_kwargs, layout, request.prompts, request.responses)
            for layout in job["layouts"]
        })
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()
    return 0


def torchrun_command(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", __name__, *args]


def launch(requests: list[ScoreRequest], layouts: list[Layout], timeout_s: float = COLLECTIVE_TIMEOUT_S,
           run_timeout_s: float = 900.0) -> list[dict]:
    """Score every request at each layout in one torchrun (the layouts share one world size);
    returns, per request, {layout name: per-sequence logprobs}."""
    sizes = {layout.world_size for layout in layouts}
    if len(sizes) != 1:
        raise ValueError(f"one launch runs layouts of one world size, got {sorted(sizes)}")
    with tempfile.TemporaryDirectory(prefix="zmrl-ranks-") as tmp:
        job, out = Path(tmp) / "job.pt", Path(tmp) / "out.pt"
        torch.save(dict(requests=requests, layouts=layouts, timeout_s=timeout_s), job)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        completed = subprocess.run(torchrun_command(sizes.pop(), str(job), str(out)), env=env,
                                   capture_output=True, text=True, timeout=run_timeout_s)
        if completed.returncode != 0 or not out.exists():
            tail = (completed.stdout + completed.stderr)[-6000:]
            raise RuntimeError(f"torchrun exited with {completed.returncode}:\n{tail}")
        return torch.load(out, weights_only=False)


if __name__ == "__main__":
    sys.exit(main())
