"""verl's main_ppo on the CPU, synchronous: the MoE model bitwise over two steps and after verl
resumes from its own checkpoint, and the stock FSDP forward as the negative control. Each test is
one or two real verl processes (main_ppo_runs.py says what they run)."""

from __future__ import annotations

import re

import pytest
from support.main_ppo_runs import (BITWISE, DIFF, SAME_WEIGHTS_LOGPROB_DIFF, assert_ran, inputs,
                           moe_inputs)  # noqa: F401 (fixtures)

from zero_mismatch_plugin.integrations.verl.cpu.launch import run_smoke

pytestmark = pytest.mark.slow


def test_moe_model_two_sync_steps_bitwise_then_resume_from_verls_checkpoint(tmp_path, moe_inputs, capsys):
    """A tiny Qwen3-MoE: the FSDP actor's MoE layers run vLLM's router and fused-MoE layer on the
    gathered experts, and the rollout receives the updated experts through vLLM's reload (CPU MoE
    layers re-padded and re-packed as at the first load); every sampled token's logprob is μ, bit
    for bit, before and after an update, and again after verl resumes from its own checkpoint.
    (The dense Llama path is bitwise in the asynchronous runs below.)"""
    checkpoints = tmp_path / "checkpoints"
    first = run_smoke(tmp_path / "first", moe_inputs,
                      [f"trainer.default_local_dir={checkpoints}", "trainer.save_freq=2"])
    assert_ran(first, [1, 2])
    assert "zero-mismatch: verl FSDP actor (Qwen3MoeForCausalLM" in first.log
    # Synchronous: the actor trains on what the current weights sampled, so pi == mu bit for bit.
    assert first.metric(BITWISE) == [1.0, 1.0], first.metric(BITWISE)
    assert first.metric(DIFF) == [0.0, 0.0]
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # `zmrl report` reads verl's own metric log of the run.
    from zero_mismatch_plugin.tools.cli import main as zmrl

    assert zmrl(["report", str(tmp_path / "first" / "metrics.jsonl")]) == 0
    assert re.search(r"steps logged\s+2\n", capsys.readouterr().out)

    resumed = run_smoke(tmp_path / "resumed", moe_inputs,
                        [f"trainer.default_local_dir={checkpoints}", "trainer.total_training_steps=3"])
    assert_ran(resumed, [3])
    assert f"Resuming from {checkpoints}/global_step_2" in resumed.log
    # The rollout samples with the resumed weights, and the aligned forward's derived weights are
    # re-derived from the loaded shards: bitwise again.
    assert resumed.metric(BITWISE) == [1.0], resumed.metric(BITWISE)


def test_stock_fsdp_forward_is_close_but_not_bitwise(tmp_path, inputs):
    # Negative control: the same run with the aligned forward off (verl's HF forward in fp32).
    run = run_smoke(tmp_path / "stock", inputs, ["++ray_kwargs.ray_init.runtime_env.env_vars.ZMRL_FSDP_ALIGNED='0'",
                                                 f"trainer.default_local_dir={tmp_path / 'checkpoints'}"])
    assert_ran(run, [1, 2])
    fractions, diffs = run.metric(BITWISE), run.metric(DIFF)
    print(f"stock FSDP forward: bitwise_equal_fraction {fractions}, log_prob_abs_diff_max {diffs}")
    assert min(fractions) < 1.0
    assert max(diffs) < SAME_WEIGHTS_LOGPROB_DIFF
