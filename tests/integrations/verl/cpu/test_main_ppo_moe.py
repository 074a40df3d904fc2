"""verl's main_ppo on the CPU with a tiny Qwen3-MoE: two synchronous steps bitwise in bf16 (verl's
FSDP mixed precision: fp32 master weights, gathered and computed in bf16; the rollout serving bf16),
saved, then FlashREINFORCE resumed in fp32 from verl's own checkpoint (its fp32 master weights) with
the rollout on its own slot, synced over gloo (separate_async). The two runs are two real verl processes, started once (``moe_runs``); every test
reads them. The negative control of the aligned actor (verl's own forward of the same FSDP2 model is
not μ) is ``tests/faces/fsdp/test_fsdp_aligned.py::test_actor_logprobs_are_the_engines_and_verls_own_forward_is_not``
and, in bf16 mixed precision, ``test_in_bf16_mixed_precision_actor_logprobs_are_the_bf16_engines_and_verls_own_forward_is_not``;
the asynchronous colocate mode runs on verl's Megatron engine (test_main_ppo_megatron.py)."""

from __future__ import annotations

import re

import pytest
from support.main_ppo_runs import (BITWISE, DIFF, SEPARATE_ASYNC, STALENESS_MIN, STALENESS_WORST_MAX,  # noqa: F401
                                   assert_ran, assert_saved_at, inputs, moe_inputs, run_verl)

pytestmark = pytest.mark.slow

SAVED_STEP = 2
# The precision users train in: verl's FSDP engine in bf16 mixed precision, the rollout in bf16.
BF16 = ["actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.rollout.dtype=bfloat16"]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, moe_inputs):
    """(the synchronous run that saves at step 2, the asynchronous run resumed from it, their directory)."""
    root = tmp_path_factory.mktemp("main_ppo_moe")
    checkpoints = root / "checkpoints"
    first = run_verl(root / "sync", moe_inputs,
                     [*BF16, f"trainer.default_local_dir={checkpoints}", f"trainer.save_freq={SAVED_STEP}"])
    assert_ran(first, [1, 2])
    # The resumed run trains three more steps asynchronously: FlashREINFORCE, one sample per prompt,
    # the rollout on its own slot one version behind after the first update.
    resumed = run_verl(root / "separate_resumed", moe_inputs, [
        "zm_algorithm=flash_reinforce", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", *SEPARATE_ASYNC,
        f"trainer.total_training_steps={SAVED_STEP + 3}", f"trainer.default_local_dir={checkpoints}"])
    return first, resumed, root


def test_sync_steps_in_bf16_are_bitwise_with_vllms_moe_layers_and_saved(moe_runs, capsys):
    """In bf16 mixed precision the FSDP actor's MoE layers run vLLM's router and fused-MoE layer on
    the experts gathered in bf16, and the rollout receives the updated experts through vLLM's reload
    (CPU MoE layers re-padded and re-packed as at the first load): every sampled token's logprob is
    μ, bit for bit, before and after an update. (verl's own forward under bf16 autocast is not μ:
    tests/faces/fsdp/test_fsdp_aligned.py.)"""
    first, _, root = moe_runs
    assert "zero-mismatch: verl FSDP actor (Qwen3MoeForCausalLM, bfloat16)" in first.log
    # Synchronous: the actor trains on what the current weights sampled, so pi == mu bit for bit.
    assert first.metric(BITWISE) == [1.0, 1.0], first.metric(BITWISE)
    assert first.metric(DIFF) == [0.0, 0.0]
    assert_saved_at(root / "checkpoints", SAVED_STEP)
    # `zmrl report` reads verl's own metric log of the run.
    from zero_mismatch_plugin.tools.cli import main as zmrl

    assert zmrl(["report", str(root / "sync" / "metrics.jsonl")]) == 0
    assert re.search(r"steps logged\s+2\n", capsys.readouterr().out)


def test_flash_reinforce_resumed_on_a_separate_rollout_is_bitwise_on_current_batches(moe_runs):
    """After verl resumes from its checkpoint, the gloo checkpoint engine pushes the resumed weights to
    the rollout on its own slot, and the aligned forward re-derives its weights from the loaded
    shards: the first batch (of the resumed version) is bitwise; every batch of the current version
    is, and a batch whose every trajectory was sampled before the latest update is not."""
    _, resumed, root = moe_runs
    assert_ran(resumed, [3, 4, 5])
    assert f"Resuming from {root / 'checkpoints'}/global_step_{SAVED_STEP}" in resumed.log
    assert resumed.metric("actor/flash_reinforce/admitted_fraction")
    staleness, stale_min, fractions = (resumed.metric(STALENESS_WORST_MAX), resumed.metric(STALENESS_MIN),
                                       resumed.metric(BITWISE))
    print(f"resumed separate_async: staleness_worst/max {staleness}, staleness/min {stale_min}, bitwise {fractions}")
    assert staleness[0] == 0 and fractions[0] == 1.0, (staleness, fractions)
    # Later batches were sampled one version behind the learner (lag >= 1).
    assert max(staleness) >= 1
    for worst, least, fraction in zip(staleness, stale_min, fractions):
        if worst == 0:
            assert fraction == 1.0
        if least >= 1:  # pi (new weights) and mu (old weights) differ
            assert fraction < 1.0
