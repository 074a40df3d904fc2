"""verl's main_ppo on the CPU with a tiny Qwen3-MoE: two synchronous steps bitwise, saved, then
FlashREINFORCE resumed from verl's own checkpoint in the asynchronous colocate mode. The two runs
are two real verl processes, started once (``moe_runs``); every test reads them."""

from __future__ import annotations

import re

import pytest
from support.main_ppo_runs import (BITWISE, DIFF, STALENESS_WORST_MAX, assert_ran, inputs,  # noqa: F401 (fixtures)
                                   moe_inputs)

from zero_mismatch_plugin.integrations.verl.cpu.launch import run_smoke

pytestmark = pytest.mark.slow

SAVED_STEP = 2


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, moe_inputs):
    """(the synchronous run that saves at step 2, the asynchronous run resumed from it, their directory)."""
    root = tmp_path_factory.mktemp("main_ppo_moe")
    checkpoints = root / "checkpoints"
    first = run_smoke(root / "sync", moe_inputs,
                      [f"trainer.default_local_dir={checkpoints}", f"trainer.save_freq={SAVED_STEP}"])
    assert_ran(first, [1, 2])
    # The resumed run trains three more steps asynchronously: FlashREINFORCE, one sample per prompt,
    # a stale batch after the first update.
    resumed = run_smoke(root / "async_resumed", moe_inputs, [
        "zm_algorithm=flash_reinforce", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.trainer_mode=colocate_async",
        f"trainer.total_training_steps={SAVED_STEP + 3}", f"trainer.default_local_dir={checkpoints}"])
    return first, resumed, root


def test_sync_steps_are_bitwise_with_vllms_moe_layers_and_saved(moe_runs, capsys):
    """The FSDP actor's MoE layers run vLLM's router and fused-MoE layer on the gathered experts, and
    the rollout receives the updated experts through vLLM's reload (CPU MoE layers re-padded and
    re-packed as at the first load): every sampled token's logprob is μ, bit for bit, before and
    after an update."""
    first, _, root = moe_runs
    assert "zero-mismatch: verl FSDP actor (Qwen3MoeForCausalLM" in first.log
    # Synchronous: the actor trains on what the current weights sampled, so pi == mu bit for bit.
    assert first.metric(BITWISE) == [1.0, 1.0], first.metric(BITWISE)
    assert first.metric(DIFF) == [0.0, 0.0]
    assert (root / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVED_STEP)
    # `zmrl report` reads verl's own metric log of the run.
    from zero_mismatch_plugin.tools.cli import main as zmrl

    assert zmrl(["report", str(root / "sync" / "metrics.jsonl")]) == 0
    assert re.search(r"steps logged\s+2\n", capsys.readouterr().out)


def test_flash_reinforce_resumed_asynchronously_is_bitwise_on_current_batches(moe_runs):
    """After verl resumes from its checkpoint, the rollout samples with the resumed weights and the
    aligned forward re-derives its weights from the loaded shards: the first batch (of the resumed
    version) is bitwise; a batch sampled before the latest update is not, and every batch of the
    current version is."""
    _, resumed, root = moe_runs
    assert_ran(resumed, [3, 4, 5])
    assert f"Resuming from {root / 'checkpoints'}/global_step_{SAVED_STEP}" in resumed.log
    assert resumed.metric("actor/flash_reinforce/admitted_fraction")
    staleness, fractions = resumed.metric(STALENESS_WORST_MAX), resumed.metric(BITWISE)
    print(f"resumed colocate_async: staleness_worst/max {staleness}, bitwise {fractions}")
    assert staleness[0] == 0 and fractions[0] == 1.0, (staleness, fractions)
    # The warm-up batch is sampled before an update and trained on after it: lag 1.
    assert max(staleness) >= 1
    for worst, fraction in zip(staleness, fractions):
        if worst == 0:
            assert fraction == 1.0
