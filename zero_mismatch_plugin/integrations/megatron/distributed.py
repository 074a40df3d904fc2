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


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """One step after scoring: the loss ``sum(c_t * logprob_t)`` (``c`` drawn from
    ``coefficient_seed``), megatron's DDP and ``finalize_model_grads``, then SGD at ``lr``."""

    coefficient_seed: int = 0
    lr: float = 1e-3


@dataclasses.dataclass
class ScoreRequest:
    """Prompt+response pairs of one checkpoint to score, with the engine arguments of their rollout
    (the layout adds its own, e.g. ``tensor_parallel_size``), and optionally a step to take."""

    model_dir: str
    engine_kwargs: dict
    prompts: list
    responses: list
    step: TrainStep | None = None


def step_coefficients(step: TrainStep, num_tokens: int) -> torch.Tensor:
    return torch.randn(num_tokens, generator=torch.Generator().manual_seed(step.coefficient_seed))


class _RankRun:
    """One request at one layout on this rank: the aligned model of the engine rank's layout."""

    def __init__(self, request: ScoreRequest, layout: Layout, dtype: str = "float32"):
        from zero_mismatch_plugin.aligned.packing import pack
        from zero_mismatch_plugin.aligned.runtime import VllmRuntime
        from zero_mismatch_plugin.integrations.megatron.standalone import build_gpt_model

        self.runtime = VllmRuntime(request.model_dir, dtype=dtype, **{**request.engine_kwargs, **layout.engine_kwargs()})
        self.model = build_gpt_model(self.runtime, aligned=True, **layout.config_overrides())
        self.batch = pack(request.prompts, request.responses)
        self.multiple = layout.tensor_model_parallel_size if layout.sequence_parallel else 1

    def logprobs(self, model=None) -> torch.Tensor:
        from zero_mismatch_plugin.integrations.megatron.standalone import packed_logits, token_logprobs_from_logits

        return token_logprobs_from_logits(packed_logits(model or self.model, self.batch, self.multiple), self.batch)

    def per_sequence(self, values: torch.Tensor) -> list[torch.Tensor]:
        return self.batch.split_per_sequence(values.detach().cpu())

    def step(self, step: TrainStep) -> dict:
        """Gradients (full, checkpoint names), the logprobs after the step, and the full weights."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        from zero_mismatch_plugin.faces.megatron import convert
        from zero_mismatch_plugin.faces.megatron.parallel import gather_full, tensor_parallel_group
        from zero_mismatch_plugin.integrations.megatron.standalone import cpu_stock_megatron

        hf, group = self.runtime.hf_config, tensor_parallel_group(self.model.config)
        with cpu_stock_megatron():
            ddp = DistributedDataParallel(self.model.config, DistributedDataParallelConfig(), self.model)
            ddp.train()
            values = self.logprobs(ddp)
            (values * step_coefficients(step, values.numel())).sum().backward()
            # megatron's own reductions: data-parallel grads, and over tensor-parallel ranks the
            # norms that see only this rank's tokens (SP) or heads (q/k norms).
            finalize_model_grads([ddp])
        grads = {name: gather_full(name, p.main_grad, group) for name, p in self.model.named_parameters()}
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(p.main_grad, alpha=-step.lr)
        ddp.eval()
        with torch.no_grad():
            after = self.logprobs(ddp)
        return dict(grads=convert.megatron_to_hf(grads, hf), logprobs_after=self.per_sequence(after),
                    weights=convert.engine_weights(self.model, hf, self.runtime.dtype))


def run_request(request: ScoreRequest, layout: Layout) -> dict:
    """``{"logprobs": per-sequence logprobs}`` (plus :meth:`_RankRun.step`'s results with a step)."""
    run = _RankRun(request, layout)
    with torch.no_grad():
        result = {"logprobs": run.per_sequence(run.logprobs())}
    if request.step is not None:
        result.update(run.step(request.step))
    return result


def main(argv=None) -> int:
    """One rank of a job written by :func:`launch` (``python -m ... JOB OUT``)."""
    import torch.distributed as dist

    job_path, out_path = (argv or sys.argv[1:])[:2]
    job = torch.load(job_path, weights_only=False)
    torch.set_num_threads(1)
    init_ranks(job["layouts"][0], job["timeout_s"])
    results = [{layout.name: run_request(request, layout) for layout in job["layouts"]} for request in job["requests"]]
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
    returns, per request, {layout name: :func:`run_request`'s result}."""
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
