"""verl's main_ppo on the CPU with a tiny Llama: REINFORCE Zero with the rollout on its own slot
synced over gloo (separate_async), bitwise on batches of the current version and not on stale ones.
One real verl process (main_ppo_runs.py says what it runs). The negative control of the aligned
actor (verl's own forward of the same FSDP2 model is not μ) is
``tests/faces/fsdp/test_fsdp_aligned.py::test_actor_logprobs_are_the_engines_and_verls_own_forward_is_not``."""

from __future__ import annotations

import pytest
from support.main_ppo_runs import (BITWISE, SEPARATE_ASYNC, STALENESS_MIN, STALENESS_WORST_MAX, assert_ran,  # noqa: F401
                                   inputs)

from zero_mismatch_plugin.integrations.verl.cpu.launch import run_smoke

pytestmark = pytest.mark.slow


def test_reinforce_zero_separate_async_rollout_synced_over_gloo(tmp_path, inputs):
    run = run_smoke(tmp_path / "separate", inputs, [
        *SEPARATE_ASYNC, "trainer.total_training_steps=3", f"trainer.default_local_dir={tmp_path / 'checkpoints'}"])
    assert_ran(run, [1, 2, 3])
    staleness, stale_min = run.metric(STALENESS_WORST_MAX), run.metric(STALENESS_MIN)
    fractions = run.metric(BITWISE)
    print(f"separate_async: staleness_worst/max {staleness}, staleness/min {stale_min}, bitwise {fractions}")
    # Step 1 samples with the weights the gloo engine pushed at start-up: every trajectory is of
    # the current version, and those are bitwise.
    assert staleness[0] == 0
    for worst, fraction in zip(staleness, fractions):
        if worst == 0:
            assert fraction == 1.0
    # Later batches were sampled one version behind the learner (lag >= 1); where every trajectory
    # is stale, pi (new weights) and mu (old weights) differ.
    assert max(staleness) >= 1
    assert all(fraction < 1.0 for least, fraction in zip(stale_min, fractions) if least >= 1)

