"""``zmrl check --dtype bfloat16`` and ``zmrl bisect --dtype bfloat16`` on a tiny Llama and a tiny
Qwen3-MoE: the engine serves bf16 (fp32 head) in consistent mode, the aligned trainer computes in
bf16, every check passes (batch composition at 1, 2 and 8 included)."""

from __future__ import annotations

import json
import os

import pytest

from zero_mismatch_plugin.tools import cli

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def module_environ(engines):
    """The checker sets ZMRL_NUMERICS (and vLLM variables) for its process; undo after."""
    engines.pool.make_room()  # room for the engines the runs start
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def run(argv, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = cli.main([*argv, "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--json", str(out), "--quiet"])
    return code, json.loads(out.read_text()), capsys.readouterr().out


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_check_bf16_passes_every_check(checkpoints, name, module_environ, tmp_path, capsys):
    code, report, table = run(["check", "--model", str(checkpoints[name]), "--batch-sizes", "1,2,8"], tmp_path, capsys)
    print(table)
    assert code == 0, table
    assert "numerics consistent" in table and all(entry["pass"] is True for entry in report.values()), report
    expected = {"sampled_token", "full_distribution", "batch_composition", "prefix_cache", "prefill_vs_decode"}
    assert set(report) == expected | ({"expert_selection"} if name == "qwen3_moe" else set()), report
    assert report["sampled_token"]["bitwise_equal_fraction"] == 1.0 and report["sampled_token"]["tokens"] == 8 * 24
    assert set(report["batch_composition"]["per_batch_size"]) == {"2", "8"}  # each against batch 1


def test_bisect_bf16_finds_every_op_equal(checkpoints, module_environ, tmp_path, capsys):
    code, report, table = run(["bisect", "--model", str(checkpoints["llama"])], tmp_path, capsys)
    print(table)
    assert code == 0, table
    assert report["pass"] is True and report["first_differing_op"] is None and report["not_compared"] == []
    assert report["ops_compared"] == 26 and all(op["bitwise_equal"] for op in report["ops"]), report
