"""``zmrl demo --compare``: every variant against one live engine, read back through ``zmrl report``'s code.

A few updates per variant (plumbing, not the effect): each variant's summary exists, the aligned
variant's logprobs at the sampling weights are the engine's bits and the bf16 learner's are not,
the gates are verl's (their metrics are logged), and the comparison is rebuilt from the logs alone.
"""

from __future__ import annotations

import json

import pytest
import torch

from support.vllm_session import demo_engine
from zero_mismatch_plugin.tools.demo.compare import (
    DEFAULT_LAG, VARIANT_NAMES, VARIANTS, CompareConfig, run_compare, run_dir,
)

MAX_MODEL_LEN = 128
UPDATES = 4


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One seed of every variant, UPDATES updates each, against one engine; (config, comparison, out_dir)."""
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    out_dir = tmp_path_factory.mktemp("compare")
    model_dir = build_tiny_model(out_dir / "model", family="llama", seed=0)
    config = CompareConfig(seeds=(0,), updates=UPDATES, lag=8, max_model_len=MAX_MODEL_LEN)
    records = {}

    def progress(variant, seed, result):
        records[variant.name] = result.records

    with demo_engine(model_dir, MAX_MODEL_LEN) as engine:
        comparison = run_compare(config, out_dir, engine, lambda seed: model_dir, progress)
    return config, comparison, out_dir, records


def test_every_variant_writes_its_summary_and_log(compared):
    config, comparison, out_dir, records = compared
    assert set(records) == set(VARIANT_NAMES)
    for name in VARIANT_NAMES:
        summary = json.loads((run_dir(out_dir, 0, name) / "summary.json").read_text())
        assert summary["updates"] == UPDATES and summary["task"] == "chain", name
        assert len((run_dir(out_dir, 0, name) / "metrics.jsonl").read_text().splitlines()) == UPDATES
    assert json.loads((run_dir(out_dir, 0, "sync_aligned") / "summary.json").read_text())["lag_max"] == 0


def test_aligned_is_bitwise_and_bf16_learner_is_not(compared):
    _, _, _, records = compared
    for name in ("aligned", "sync_aligned"):
        for r in records[name]:
            # scored with the weights that sampled them, every token is the engine's bits
            assert all(b is True for b in r.own_version_bitwise), (name, r.step)
            for version, ratios_one in zip(r.sample_versions, r.ratios_all_one):
                if version == r.learner_version:
                    assert ratios_one, (name, r.step)
    for name in ("standard_is", "standard_is_seq_gate", "standard_is_token_gate"):
        fractions = [r.metrics["demo/own_version/bitwise_equal_fraction"] for r in records[name]]
        gaps = [r.metrics["demo/own_version/log_prob_abs_diff_max"] for r in records[name]]
        print(f"{name}: bit-equal fraction at the sampling weights {min(fractions):.3f}..{max(fractions):.3f}, "
              f"max |dlogprob| {max(gaps):.3g}")
        assert not all(all(r.own_version_bitwise) for r in records[name]), name
        assert max(gaps) < 1.0, name  # bf16 rounding, not a different model


def test_gates_are_verls_and_only_on_gated_variants(compared):
    _, _, _, records = compared
    key = "actor/rollout_corr/rollout_rs_seq_masked_fraction"
    for name in ("standard_is_seq_gate", "standard_is_token_gate"):
        assert all(key in r.metrics for r in records[name]), name
    assert all("actor/rollout_corr/rollout_rs_seq_mean_k3_seq_masked_fraction" in r.metrics
               for r in records["standard_is_seq_gate"])
    assert all("actor/rollout_corr/rollout_rs_token_k3_masked_fraction" in r.metrics
               for r in records["standard_is_token_gate"])
    for name in ("aligned", "standard_is", "sync_aligned"):
        assert not any(key in r.metrics for r in records[name]), name


def test_report_reads_every_variant_and_rebuilds_the_comparison(compared):
    from zero_mismatch_plugin.tools.report.compare import COMPARE_TEXT, FIGURE1, FIGURE3, read_comparison

    _, comparison, out_dir, _ = compared
    rebuilt = read_comparison(out_dir)  # from the metric logs alone
    for name in VARIANT_NAMES:
        ours = rebuilt["figures"][name]["0"]
        assert ours == comparison["figures"][name]["0"], name
        assert ours["reward_first"] is not None and ours["grad_norm_max"] is not None, name
        assert ours["d3_median"] is not None, name
    assert rebuilt["figures"]["aligned"]["0"]["own_version_bitwise_min"] == 1.0
    assert rebuilt["figures"]["standard_is"]["0"]["own_version_bitwise_min"] < 1.0
    assert rebuilt["figures"]["standard_is"]["0"]["rejected_seqs_last"] == "none (no gate)"
    assert isinstance(rebuilt["figures"]["standard_is_seq_gate"]["0"]["rejected_seqs_last"], float)
    text = (out_dir / COMPARE_TEXT).read_text()
    assert "442.54x" in text and "24.48%" in text  # the paper's column
    for name in (FIGURE1, FIGURE3, "seed-0/d3.png"):
        assert (out_dir / "plots" / name).stat().st_size > 0, name
    assert "standard_is_token_gate" in (out_dir / "seed-0" / "report.txt").read_text()


def test_chain_task_rewards_digits_and_alternating_parity():
    from zero_mismatch_plugin.tools.demo.task import ChainTask

    # token id -> digit value; 7 is not a digit token
    task = ChainTask(prompts=[[7]], vocab_size=8, digit_values={1: 1, 2: 2, 3: 3, 4: 4})
    assert task.reward([7], [1, 2, 3, 4]) == 1.0  # digits, alternating parity
    assert task.reward([7], [1, 3, 2, 4]) == (1 + 0.5 + 1 + 0.5) / 4  # 1 -> 3 and 2 -> 4 keep parity
    assert task.reward([7], [1, 7, 2, 7]) == (1 + 0 + 0.5 + 0) / 4  # a digit after a non-digit: half
    assert task.reward([7], [7, 7]) == 0.0 and task.reward([7], []) == 0.0
    # uniformly random tokens: half of 4/8 digits, plus half of digit-after-other-parity-digit
    assert task.chance_reward == 0.5 * 0.5 + 0.5 * 0.5 * 0.5 * 0.5


def test_baselines_are_the_ablation_recipes_settings():
    from zero_mismatch_plugin.tools.demo.corrections import rollout_correction_settings

    algorithm, plain = rollout_correction_settings("is")
    assert algorithm["adv_estimator"] == "grpo" and algorithm["norm_adv_by_std_in_grpo"] is False
    assert plain["loss_type"] == "reinforce" and plain["rollout_is"] == "token" and plain["rollout_rs"] is None
    assert plain["rollout_is_threshold"] >= 1e9  # effectively unclipped
    assert rollout_correction_settings("is_sequence_gate")[1]["rollout_rs"] == "seq_mean_k3"
    assert rollout_correction_settings("is_token_gate")[1]["rollout_rs"] == "token_k3"
    with pytest.raises(ValueError, match="rollout correction must be one of"):
        rollout_correction_settings("clip")


def test_bf16_learner_trains_fp32_master_weights(tmp_path):
    from zero_mismatch_plugin.tools.demo.learners import MixedPrecisionLearner, StandardLearner
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", family="llama", seed=0)
    fp32, bf16 = StandardLearner(model_dir), MixedPrecisionLearner(model_dir)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    with torch.no_grad():
        exact = torch.cat(fp32.response_logprobs(prompts, responses))
    mixed = torch.cat(bf16.response_logprobs(prompts, responses))
    gap = (mixed.detach() - exact).abs().max().item()
    print(f"bf16 mixed precision vs fp32: max |dlogprob| {gap:.3g}")
    assert mixed.dtype == torch.float32 and 0 < gap < 0.5
    mixed.sum().backward()
    for name, p in bf16.module.named_parameters():
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32), name
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bf16.module.parameters())


def test_compare_cli_refuses_single_run_options(capsys):
    from zero_mismatch_plugin.tools.cli import main

    assert main(["demo", "--compare", "--kernels", "standard"]) == 2
    assert "--kernels" in capsys.readouterr().err
    assert main(["demo", "--seeds", "0,1"]) == 2
    with pytest.raises(ValueError, match="repeats a seed"):
        CompareConfig(seeds=(0, 0))
    with pytest.raises(ValueError, match="--lag must be at least 1"):
        CompareConfig(lag=0)


def test_bf16_engine_aligned_learner_bitwise_and_bf16_learner_not(tmp_path):
    """``zmrl demo --compare --dtype bf16``'s plumbing: the engine serves bf16 in consistent mode, the
    aligned learner (fp32 master weights, the engine's bf16 copies) scores the samples of its own
    version with the engine's bits, the standard bf16 learner does not; the run records the dtype."""
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", family="llama", seed=0)
    config = CompareConfig(seeds=(0,), updates=3, lag=8, max_model_len=MAX_MODEL_LEN,
                           variants=("aligned", "standard_is"), dtype="bfloat16")
    records = {}

    def progress(variant, seed, result):
        records[variant.name] = result.records

    with demo_engine(model_dir, MAX_MODEL_LEN, dtype="bfloat16") as engine:
        run_compare(config, tmp_path, engine, lambda seed: model_dir, progress)
    for r in records["aligned"]:
        assert all(b is True for b in r.own_version_bitwise), r.step
    assert not all(all(r.own_version_bitwise) for r in records["standard_is"])
    gaps = [r.metrics["demo/own_version/log_prob_abs_diff_max"] for r in records["standard_is"]]
    print(f"bf16 engine: the standard bf16 learner's max |dlogprob| at the sampling weights {max(gaps):.3g}")
    for name in ("aligned", "standard_is"):
        summary = json.loads((run_dir(tmp_path, 0, name) / "summary.json").read_text())
        assert summary["dtype"] == "bfloat16", summary


def test_demo_dtype_learning_rate_and_fixed_lag_flags_reach_both_commands_and_bad_values_are_refused(monkeypatch):
    from zero_mismatch_plugin.tools import cli
    from zero_mismatch_plugin.tools.demo import command
    from zero_mismatch_plugin.tools.demo.runner import DemoConfig

    seen = []
    monkeypatch.setattr(command, "run_demo_command", lambda *a, dtype, learning_rate, fixed_lag, **k:
                        seen.append(("demo", dtype, learning_rate, fixed_lag)) or 0)
    monkeypatch.setattr(command, "run_compare_command", lambda *a, dtype, learning_rate, fixed_lag, **k:
                        seen.append(("compare", dtype, learning_rate, fixed_lag)) or 0)
    assert cli.main(["demo", "--dtype", "bf16"]) == 0
    assert cli.main(["demo", "--compare", "--dtype", "bf16", "--learning-rate", "3e-5", "--fixed-lag"]) == 0
    assert cli.main(["demo", "--fixed-lag"]) == 0
    assert seen == [("demo", "bfloat16", 1e-4, False), ("compare", "bfloat16", 3e-5, True),
                    ("demo", "float32", 1e-4, True)]
    # Every asynchronous variant of a fixed-lag comparison runs at that fixed lag; the reference stays synchronous.
    runs = {v.name: v.demo_config(CompareConfig(fixed_lag=True), seed=0) for v in VARIANTS}
    assert {name: (c.lag, c.fixed_lag) for name, c in runs.items()} == {
        name: (0 if name == "sync_aligned" else DEFAULT_LAG, True) for name in runs}
    with pytest.raises(ValueError, match="--dtype must be one of"):
        DemoConfig(dtype="float16")
    with pytest.raises(ValueError, match="--learning-rate must be a positive number"):
        DemoConfig(learning_rate=0.0)
    with pytest.raises(ValueError, match="--learning-rate must be a positive number"):
        CompareConfig(learning_rate=-1e-4)
