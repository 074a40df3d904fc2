"""``zmrl demo``: asynchronous RL against a live vLLM engine, checked on CPU.

One engine (in its own process) serves every configuration in this file (the demo loads each run's
initial weights into it as version 0), so the file pays for a single engine start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.vllm_session import demo_llama_engine
from zero_mismatch_plugin.tools.demo import DemoConfig, run_demo

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    """(engine, model directory) in consistent numerics; the variables are restored afterwards."""
    yield from demo_llama_engine(tmp_path_factory, "demo_model", MAX_MODEL_LEN)


def _run(demo_engine, model_dir=None, **overrides):
    engine, engine_model_dir = demo_engine
    config = DemoConfig(max_model_len=MAX_MODEL_LEN, **overrides)
    return run_demo(config, engine, model_dir or engine_model_dir)


def _per_sample(result):
    """(learner version, sample version, every IS ratio == 1, own-version bitwise) for every sample."""
    return [
        (r.learner_version, version, ratios_one, own_bitwise)
        for r in result.records
        for version, ratios_one, own_bitwise in zip(r.sample_versions, r.ratios_all_one, r.own_version_bitwise)
    ]


def _assert_only_gap_is_lag(result, lag):
    samples = _per_sample(result)
    for learner_version, version, ratios_one, own_bitwise in samples:
        assert 0 <= learner_version - version <= lag, (learner_version, version)
        # Scored with the weights that sampled it, every token is the engine's bits ...
        assert own_bitwise is True, (learner_version, version)
        # ... so a ratio != 1 can only come from weight lag.
        if version == learner_version:
            assert ratios_one, f"sample of the learner's own version {version} has an IS ratio != 1"
    fresh = [s for s in samples if s[0] == s[1]]
    older = [s for s in samples if s[0] != s[1]]
    # Both kinds must occur, or the check above says nothing.
    assert fresh and older, (len(fresh), len(older))
    assert any(not ratios_one for _, _, ratios_one, _ in older), "older weights must change some ratio"
    for record in result.records:
        assert record.metrics["demo/own_version/bitwise_equal_fraction"] == 1.0
        assert record.metrics["demo/own_version/k3_kl"] == 0.0


def test_smoke_mechanics_and_outputs(demo_engine, tmp_path):
    """A few asynchronous updates: versions, lag bound, verl-format log, report, plots, summary."""
    from zero_mismatch_plugin.tools.demo.outputs import write_outputs
    from zero_mismatch_plugin.tools.report import load_runs

    result = _run(demo_engine, lag=1, updates=6)
    assert [r.step for r in result.records] == list(range(1, 7))
    assert [r.learner_version for r in result.records] == list(range(6))
    assert result.records[0].sample_versions == [0] * 32  # nothing newer exists at the first update
    for r in result.records:
        assert len(r.sample_versions) == 32
        assert all(0 <= r.learner_version - v <= 1 for v in r.sample_versions)

    summary = write_outputs(result, tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6
    first = json.loads(lines[0])
    assert set(first) == {"step", "data"} and first["step"] == 1
    for key in ("actor/rollout_corr/k3_kl", "actor/rollout_corr/kl", "actor/zero_mismatch/bitwise_equal_fraction",
                "actor/grad_norm", "critic/score/mean", "training/off_policy/trajectory_staleness/mean",
                "training/off_policy/trajectory_staleness/max", "actor/rollout_corr/rollout_is_mean"):
        assert key in first["data"], key
    run = load_runs([str(tmp_path / "metrics.jsonl")])[0]
    assert run.formats == {"verl-file"}
    for name in ("d3.png", "kl.png", "reward.png", "grad_norm.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in ("bitwise_equal_fraction_min", "lag_max", "reward_first", "reward_last", "d3_peak_to_median",
                "updates", "updates_per_second"):
        assert key in on_disk, key
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["updates"] == 6 and on_disk["lag_max"] <= 1 and on_disk["bitwise_equal_fraction_min"] == 1.0


def _run_recording(demo_engine, **overrides):
    """A demo run that also keeps each update's samples and the weights of every version."""
    from zero_mismatch_plugin.tools.demo import DemoRun

    engine, model_dir = demo_engine
    run = DemoRun(DemoConfig(max_model_len=MAX_MODEL_LEN, **overrides), engine, model_dir)
    weights = {0: run.learner.snapshot()}
    samples = []
    update = run._update

    def recording_update(step, chunks, waited):
        samples.append([s for c in chunks for s in c.samples])
        return update(step, chunks, waited)

    run._update = recording_update

    def after_update(record):  # the learner now holds (and has published) the next version
        weights[record.learner_version + 1] = run.learner.snapshot()

    return run, run.run(after_update), weights, samples


def test_aligned_lag0_every_token_bitwise_every_ratio_one(demo_engine):
    run, result, weights, samples = _run_recording(demo_engine, lag=0, updates=8)
    for r in result.records:
        assert r.sample_versions == [r.learner_version] * len(r.sample_versions)
        assert all(r.ratios_all_one), f"update {r.step}: an IS ratio != 1"
        assert all(r.own_version_bitwise), f"update {r.step}: a token is not bitwise equal"
        m = r.metrics
        assert m["actor/zero_mismatch/bitwise_equal_fraction"] == 1.0
        assert m["actor/rollout_corr/rollout_is_min"] == m["actor/rollout_corr/rollout_is_max"] == 1.0
        assert m["actor/rollout_corr/k3_kl"] == 0.0
        assert m["training/off_policy/trajectory_staleness/max"] == 0.0
    # The checks above would pass trivially with frozen weights, or with an engine that ignored
    # every publish: the parameters moved ...
    initial, final = weights[0], run.learner.snapshot()
    assert any(not torch.equal(final[name], initial[name]) for name in initial)
    # ... and the engine served the new ones: the last update's samples (drawn by version 7)
    # carry μ equal to the learner's logprobs under version 7, not under the initial weights.
    last = samples[-1]
    version = last[0].version
    assert version == 7 and all(s.version == version for s in last)
    prompts, responses = [s.prompt for s in last], [s.response for s in last]
    mu = torch.cat([s.mu for s in last])
    with torch.no_grad():
        with run.learner.weights_of(weights[version]):
            served = torch.cat(run.learner.response_logprobs(prompts, responses))
        with run.learner.weights_of(initial):
            initial_logprobs = torch.cat(run.learner.response_logprobs(prompts, responses))
    assert torch.equal(served, mu)
    assert not torch.equal(initial_logprobs, mu)


def test_aligned_lag2_only_gap_is_weight_lag(demo_engine):
    result = _run(demo_engine, lag=2, updates=24)
    _assert_only_gap_is_lag(result, lag=2)


def test_standard_kernels_at_lag0_are_close_and_report_their_gap(demo_engine):
    """A plain transformers forward on the same weights: close to the engine (fp32 round-off).
    How many tokens come out bit-equal depends on the host's kernels (printed); what the demo
    reports must follow from it: a sample with every token equal has every IS ratio 1."""
    result = _run(demo_engine, kernels="standard", lag=0, updates=5)
    fractions = []
    for r in result.records:
        m = r.metrics
        assert m["training/off_policy/trajectory_staleness/max"] == 0.0
        assert m["actor/zero_mismatch/log_prob_abs_diff_max"] < 1e-3  # same model, fp32 round-off
        # At lag 0 the learner's current weights are the sampling weights: both fractions agree.
        assert m["demo/own_version/bitwise_equal_fraction"] == m["actor/zero_mismatch/bitwise_equal_fraction"]
        assert (m["actor/rollout_corr/k3_kl"] == 0.0) or m["actor/zero_mismatch/bitwise_equal_fraction"] < 1.0
        for own_bitwise, ratios_one in zip(r.own_version_bitwise, r.ratios_all_one):
            assert ratios_one or not own_bitwise  # equal logprobs give IS ratio exactly 1
        fractions.append(m["actor/zero_mismatch/bitwise_equal_fraction"])
    print(f"standard kernels on this host: {min(fractions):.1%} .. {max(fractions):.1%} of tokens bit-equal")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reward_improves_at_lag2(demo_engine, tmp_path, seed):
    """The demo learns asynchronously: last fifth of updates beats the first, on three seeds."""
    from zero_mismatch_plugin.tools.demo.outputs import write_outputs
    from zero_mismatch_plugin.tools.tiny_models import build_tiny_model

    # Each seed is its own model and prompts; the shared engine receives its weights as version 0.
    model_dir = build_tiny_model(tmp_path / "model", family="llama", seed=seed)
    result = _run(demo_engine, model_dir=model_dir, lag=2, updates=100, seed=seed)
    summary = write_outputs(result, tmp_path / "out")
    assert summary["reward_window"] == 20
    assert summary["reward_last"] > summary["reward_first"], summary
    _assert_only_gap_is_lag(result, lag=2)


def test_rollout_error_reaches_the_learner_and_engine_serves_on(demo_engine):
    """A failure inside the engine's process is raised in the learner; the next run still works."""
    with pytest.raises(RuntimeError, match="Sample larger than population"):
        _run(demo_engine, lag=0, updates=1, prompts_per_update=1024)  # more prompts than the pool
    assert len(_run(demo_engine, lag=1, updates=2).records) == 2


def test_weight_mailbox_hands_over_the_newest_version():
    import multiprocessing

    import torch

    from zero_mismatch_plugin.tools.demo.rollout import WeightMailbox

    weights = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(4))]
    mailbox = WeightMailbox(weights).attach(multiprocessing.get_context("spawn").Lock())
    assert mailbox.take_newer(None) is None  # nothing published yet
    mailbox.put(0, weights)
    mailbox.put(1, [(n, t * 2) for n, t in weights])  # supersedes version 0
    version, taken = mailbox.take_newer(None)
    assert version == 1 and [n for n, _ in taken] == ["a", "b"]
    assert all(torch.equal(t, w * 2) for (_, t), (_, w) in zip(taken, weights))
    assert mailbox.take_newer(1) is None  # already loaded
    with pytest.raises(ValueError):
        mailbox.put(2, list(reversed(weights)))


def test_weight_mailbox_keeps_the_last_versions_for_a_fixed_lag():
    import multiprocessing

    from zero_mismatch_plugin.tools.demo.rollout import RolloutPlan, WeightMailbox

    weights = [("a", torch.arange(6.0).view(2, 3))]
    plan = RolloutPlan(seed=0, prompts_per_chunk=1, samples_per_prompt=1, response_tokens=1,
                       chunks_per_update=1, lag=2, total_chunks=8, fixed_lag=True)
    assert [plan.sampling_version(u) for u in range(5)] == [0, 0, 0, 1, 2]
    mailbox = WeightMailbox(weights, slots=plan.lag + 1).attach(multiprocessing.get_context("spawn").Lock())
    for version in range(4):
        mailbox.put(version, [("a", weights[0][1] + version)])
    assert mailbox.take_newer(None)[0] == 3  # the newest, as with one slot
    for version in (1, 2, 3):  # the last lag + 1 versions, each its own tensors
        taken_version, taken = mailbox.take_version(version, loaded=None)
        assert taken_version == version and torch.equal(taken[0][1], weights[0][1] + version)
    assert mailbox.take_version(2, loaded=2) is None  # already loaded
    with pytest.raises(RuntimeError, match="version 0 asked for, but its mailbox slot holds version 3"):
        mailbox.take_version(0, loaded=None)  # overwritten by version 3


def test_fixed_lag_trains_every_update_on_samples_exactly_lag_versions_old(demo_engine):
    """With ``fixed_lag`` the learner (fast here: the tiny model) cannot shorten the lag: update u
    trains on version u - 2 exactly, where the bound alone lets the engine hand over newer ones."""
    lag, updates = 2, 8
    result = _run(demo_engine, lag=lag, updates=updates, fixed_lag=True)
    for record in result.records:
        expected = max(0, record.learner_version - lag)
        assert record.sample_versions == [expected] * len(record.sample_versions), record.step
        assert all(record.own_version_bitwise)
    assert [r.metrics["training/off_policy/trajectory_staleness/max"] for r in result.records] == \
        [0.0, 1.0] + [2.0] * (updates - 2)


# ----- the command: its claim checked, its files written as they come ---------------------------


@pytest.fixture
def demo_command(demo_engine, monkeypatch):
    """``run_demo_command`` against the module's engine (the command would start its own): it builds
    its model, loads it into this engine as version 0 and leaves the engine running."""
    import contextlib
    import os

    from zero_mismatch_plugin.tools.demo import command

    engine, _ = demo_engine
    monkeypatch.setattr("zero_mismatch_plugin.tools.demo.engine.start_engine",
                        lambda *args, **kwargs: contextlib.nullcontext(engine))
    saved = dict(os.environ)
    yield command.run_demo_command
    os.environ.clear()
    os.environ.update(saved)


def _plant_one_wrong_logprob(monkeypatch):
    """The aligned learner's logprob of one token of its first sample, one ulp off, at one update."""
    from zero_mismatch_plugin.tools.demo.learners import AlignedLearner

    honest = AlignedLearner.response_logprobs
    calls = []

    def planted(self, prompts, responses):
        rows = honest(self, prompts, responses)
        calls.append(1)
        if len(calls) == 2:  # the second forward: update 2's, every sample of the learner's own version
            off = torch.nextafter(rows[0][:1].detach(), torch.tensor([0.0])) - rows[0][:1].detach()
            rows[0] = rows[0] + torch.nn.functional.pad(off, (0, rows[0].numel() - 1))
        return rows

    monkeypatch.setattr(AlignedLearner, "response_logprobs", planted)


def test_command_streams_metrics_and_keeps_its_bitwise_claim(demo_command, tmp_path, capsys):
    out = tmp_path / "out"
    lines_seen = []
    from zero_mismatch_plugin.tools.demo import outputs

    append = outputs.MetricsLog.append

    def counting_append(self, record):
        append(self, record)
        lines_seen.append(len((out / "metrics.jsonl").read_text().splitlines()))  # on disk at once

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(outputs.MetricsLog, "append", counting_append)
        code = demo_command("reinforce_zero", "aligned", lag=0, updates=3, seed=0, out=str(out))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert lines_seen == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bitwise_claim_holds"] is True and summary["own_version_samples_not_bitwise"] == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert not (out / ".zmrl-demo.lock").exists()  # released: the outputs now refuse a second run
    assert "ERROR" not in captured.err


def test_command_fails_loudly_when_a_same_version_sample_is_not_bitwise(demo_command, tmp_path, capsys,
                                                                        monkeypatch):
    _plant_one_wrong_logprob(monkeypatch)
    out = tmp_path / "out"
    code = demo_command("reinforce_zero", "aligned", lag=0, updates=2, seed=0, out=str(out))
    captured = capsys.readouterr()
    assert code == 1
    assert ("ERROR: the bitwise claim does not hold: 1 of 64 samples scored with the weights that sampled them "
            "differ from vLLM's logprobs") in captured.err
    assert "1 of 64 samples of the learner's own version have an IS ratio != 1" in captured.err
    summary = json.loads((out / "summary.json").read_text())  # the evidence is kept
    assert summary["bitwise_claim_holds"] is False and summary["bitwise_equal_fraction_min"] < 1


def test_command_on_a_full_disk_names_the_file_and_keeps_the_rest(demo_command, tmp_path, capsys, monkeypatch):
    import builtins
    import errno
    import io
    import os

    from zero_mismatch_plugin.tools.demo import outputs

    class FullDisk(io.StringIO):
        """A file on a disk that fills after half of what is written to it."""

        def __init__(self, path):
            super().__init__()
            self.path = path

        def write(self, text):
            self.path.write_text(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        if "summary.json" in str(path) and "w" in mode:
            return FullDisk(Path(path))
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(outputs, "open", open_on_a_full_disk, raising=False)
    out = tmp_path / "out"
    code = demo_command("reinforce_zero", "aligned", lag=0, updates=2, seed=0, out=str(out))
    captured = capsys.readouterr()
    assert code == 2
    assert f"ERROR: could not write {out / 'summary.json'}: No space left on device" in captured.err
    assert "Traceback" not in captured.err
    assert "bitwise equal      min 1 of tokens" in captured.out  # the summary is still printed
    assert not (out / "summary.json").exists()  # absent, not half-written
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert "bitwise" in (out / "report.txt").read_text()
    assert (out / "plots" / "reward.png").stat().st_size > 0


def test_a_second_demo_on_the_same_out_is_refused(tmp_path):
    from zero_mismatch_plugin.tools.demo.command import OutDirError, prepare_out_dir, release_out_dir

    out = tmp_path / "out"
    first = prepare_out_dir(str(out))
    with pytest.raises(OutDirError, match=r"is in use by a zmrl demo \(pid \d+\) \(lock file .*\.zmrl-demo\.lock\); "
                                          r"choose another directory with --out"):
        prepare_out_dir(str(out))
    (first / "metrics.jsonl").write_text("{}\n")
    release_out_dir(first)
    with pytest.raises(OutDirError, match=r"holds another zmrl demo run's outputs \(metrics\.jsonl\)"):
        prepare_out_dir(str(out))


def test_the_default_out_moves_on_to_a_free_name(tmp_path, monkeypatch):
    from zero_mismatch_plugin.tools.demo.command import prepare_out_dir, release_out_dir

    monkeypatch.chdir(tmp_path)
    first = prepare_out_dir(None)
    second = prepare_out_dir(None)  # while the first still runs
    assert (first.name, second.name) == ("zmrl-demo-out", "zmrl-demo-out-2")
    release_out_dir(first)
    release_out_dir(second)
