"""``scripts/gpu_check.sh`` / ``scripts/gpu_check.py``: the check's logic, on the CPU.

The check runs the plugin's own trainer path (op layer, ``AlignedCausalLM``); here it runs as a
dry run on vLLM's CPU kernels (``--device cpu``), which proves nothing about a GPU but exercises
every part but the engine one. Planted faults: a batch-variant op in the op layer must make the
check FAIL (exit 1); a part that cannot run (no vLLM, no GPU, not selected) must make it
INCOMPLETE (exit 2), never PASS.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import REPO  # noqa: E402
TRAINER_PARTS = ("op_backward_float64", "aligned_forward_batch_invariant", "aligned_backward_float64")


@pytest.fixture
def gpu_check(monkeypatch):
    """The script as a module; os.environ restored afterwards (the check selects consistent mode)."""
    spec = importlib.util.spec_from_file_location("zmrl_gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "FAMILIES", ("llama",))  # one family is enough for the logic
    saved = dict(os.environ)
    yield module
    os.environ.clear()
    os.environ.update(saved)


def test_dry_run_runs_the_trainer_path_and_is_incomplete_without_the_engine(tmp_path):
    """Through the shell script, as on a device: every trainer part runs and passes on the CPU;
    the engine part runs only on a GPU, so the result is INCOMPLETE (exit 2), never PASS."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:])
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in TRAINER_PARTS:
        assert summary["parts"][name]["status"] == "PASS", summary["parts"][name]
    engine = summary["parts"]["vllm_bf16_equality"]
    assert engine["status"] == "NOT RUN" and "GPU only" in engine["details"]
    assert summary["overall"] == "INCOMPLETE"
    assert "did not run: vllm_bf16_equality" in proc.stdout
    assert "group trainer: PASS" in proc.stdout  # a group's result, not the check's
    assert proc.stdout.strip().splitlines()[-1] == "overall: INCOMPLETE"
    assert "overall: PASS" not in proc.stdout


def test_a_batch_variant_op_fails_the_check(gpu_check, monkeypatch, tmp_path, capsys):
    """An RMSNorm whose bits depend on how many rows share the call (as reductions split by batch
    size do on GPUs) planted in the op layer: the forward part must FAIL."""
    from zero_mismatch_plugin.aligned import ops

    kernel = ops.AlignedRMSNorm.kernel

    def batch_variant(self, x, residual=None):
        out = kernel(self, x, residual)
        if x.shape[0] <= 40:
            return out
        return (out[0] * (1 + 2**-20), out[1]) if isinstance(out, tuple) else out * (1 + 2**-20)

    args = ["--device", "cpu", "--parts", "aligned_forward_batch_invariant", "--json", str(tmp_path / "s.json")]
    assert gpu_check.main(args) == 2  # control: passes, the other parts not selected
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["parts"]["aligned_forward_batch_invariant"]["status"] == "PASS"
    assert summary["parts"]["op_backward_float64"]["details"] == "not selected (--parts)"

    monkeypatch.setattr(ops.AlignedRMSNorm, "kernel", batch_variant)
    assert gpu_check.main(args) == 1
    summary = json.loads((tmp_path / "s.json").read_text())
    part = summary["parts"]["aligned_forward_batch_invariant"]
    assert "overall: FAIL" in capsys.readouterr().out
    print("planted batch-variant RMSNorm:", part["details"])
    assert part["status"] == "FAIL" and summary["overall"] == "FAIL"
    assert not all(part["details"]["llama float32"]["alone_equals_packed"])


def test_without_vllm_the_parts_that_need_it_do_not_run_and_the_result_is_incomplete(gpu_check, monkeypatch, tmp_path, capsys):
    """As on a GPU machine without vLLM: the op layer's backward still runs; every part that needs
    vLLM's kernels is NOT RUN with its reason, and the result says which."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    assert gpu_check.main(["--device", "cpu", "--json", str(tmp_path / "s.json")]) == 2
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["parts"]["op_backward_float64"]["status"] == "PASS"
    missing = ("aligned_forward_batch_invariant", "aligned_backward_float64", "vllm_bf16_equality")
    for name in missing:
        assert summary["parts"][name]["status"] == "NOT RUN"
        assert summary["parts"][name]["details"].startswith("vllm is not installed")
    assert f"did not run: {', '.join(missing)}" in out and "overall: INCOMPLETE" in out


def test_a_wrong_backward_fails_the_op_part(gpu_check, monkeypatch):
    """The op part compares the op layer's own backward: a wrong term in it is caught."""
    from zero_mismatch_plugin.aligned import ops

    ok, details = gpu_check.op_backward_float64("cpu")
    assert ok, details
    norm_backward = ops._norm_backward
    monkeypatch.setattr(ops, "_norm_backward", lambda x, w, g, eps: tuple(
        t * 1.001 if t is not None else None for t in norm_backward(x, w, g, eps)))
    ok, details = gpu_check.op_backward_float64("cpu")
    print("op backward with a scaled RMSNorm gradient:", details["relative_errors"])
    assert not ok and details["relative_errors"]["rms_norm"] > gpu_check.OP_GRAD_REL_TOL
    assert details["relative_errors"]["attention"] < gpu_check.OP_GRAD_REL_TOL


def _write_group(directory, group, statuses):
    parts = {name: {"status": status, "details": {}} for name, status in statuses.items()}
    (directory / f"{group}.json").write_text(json.dumps({"parts": parts, "environment": {}}))


def test_summary_is_incomplete_until_every_part_of_every_group_passed(gpu_check, tmp_path, capsys):
    _write_group(tmp_path, "trainer", {name: "PASS" for name in TRAINER_PARTS})
    _write_group(tmp_path, "engine", {"vllm_bf16_equality": "NOT RUN"})
    assert gpu_check.summarize(tmp_path)["overall"] == "INCOMPLETE"
    assert gpu_check.main(["--summarize", str(tmp_path), "--json", str(tmp_path / "s.json")]) == 2
    assert "did not run: vllm_bf16_equality" in capsys.readouterr().out
    _write_group(tmp_path, "engine", {"vllm_bf16_equality": "PASS"})
    assert gpu_check.summarize(tmp_path)["overall"] == "PASS"
    assert gpu_check.main(["--summarize", str(tmp_path), "--json", str(tmp_path / "s.json")]) == 0


def test_summary_fails_on_a_failed_crashed_or_timed_out_group(gpu_check, tmp_path):
    passed = {name: "PASS" for name in TRAINER_PARTS}
    _write_group(tmp_path, "trainer", {**passed, "aligned_backward_float64": "FAIL"})
    _write_group(tmp_path, "engine", {"vllm_bf16_equality": "PASS"})
    assert gpu_check.summarize(tmp_path)["overall"] == "FAIL"
    _write_group(tmp_path, "trainer", passed)
    assert gpu_check.summarize(tmp_path, timed_out=["engine"])["overall"] == "FAIL"
    (tmp_path / "engine.json").unlink()  # the engine group crashed before writing anything
    summary = gpu_check.summarize(tmp_path)
    assert summary["overall"] == "FAIL" and summary["parts"]["engine"]["status"] == "FAIL"


def test_a_missing_required_part_is_incomplete_even_if_all_others_passed(gpu_check):
    parts = {name: {"status": "PASS"} for name in gpu_check.required_parts(None)}
    assert gpu_check.overall_status(parts, gpu_check.required_parts(None)) == "PASS"
    del parts["aligned_forward_batch_invariant"]
    assert gpu_check.overall_status(parts, gpu_check.required_parts(None)) == "INCOMPLETE"
    assert gpu_check.overall_status(parts, gpu_check.required_parts("engine")) == "PASS"


def test_no_device_is_a_failure_not_a_pass(gpu_check, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda", "--json", str(tmp_path / "s.json")]) == 1
    assert json.loads((tmp_path / "s.json").read_text())["parts"]["device"]["status"] == "FAIL"
