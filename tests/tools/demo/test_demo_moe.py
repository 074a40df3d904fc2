"""``zmrl demo --model moe``: asynchronous RL on a tiny Qwen3-MoE, end to end through the command.

The command builds the model, starts its own engine and trains; every sample scored with the
weights that sampled it must be the engine's bits (expert weights synced through vLLM's loader
after every update), so only samples of older versions have IS ratios other than 1.
"""

from __future__ import annotations

import json
import os

import pytest

from zero_mismatch_plugin.tools import cli


@pytest.fixture
def demo_environ():
    """The demo sets ZMRL_NUMERICS and vLLM variables for its process; restored after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_demo_moe_stays_bitwise_on_same_version_samples(demo_environ, engines, tmp_path, capsys):
    engines.pool.make_room()  # room for the engine started here
    out = tmp_path / "out"
    code = cli.main(["demo", "--model", "moe", "--updates", "8", "--lag", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0
    assert "a tiny Qwen3-MoE" in printed
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "moe" and summary["updates"] == 8
    # Every token, scored with the version that sampled it, is the engine's logprob bit for bit.
    assert summary["bitwise_equal_fraction_min"] == 1.0 and summary["own_version_d3_max"] == 0.0
    assert summary["fresh_samples"] > 0 and summary["fresh_samples_with_is_ratio_not_one"] == 0
    # Older versions occurred and their ratios moved: weight lag, the only gap left.
    assert summary["older_samples"] > 0 and summary["older_samples_with_is_ratio_not_one"] > 0
    rows = [json.loads(line)["data"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["demo/own_version/bitwise_equal_fraction"] == 1.0 for r in rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "moe", "--turns", "2"], "prefix cache"),
        (["--model", "moe", "--compare"], "--model moe chooses a single run"),
    ],
)
def test_demo_moe_refuses_what_it_does_not_run(argv, message, tmp_path, capsys):
    code = cli.main(["demo", *argv, "--out", str(tmp_path / "out")])
    assert code == 2
    assert message in capsys.readouterr().err
