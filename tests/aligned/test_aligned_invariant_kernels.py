"""The batch-invariant GPU kernels compute the right numbers (Triton interpreter, on CPU), and
``scripts/gpu_check.sh`` reports PASS only when every part, the vLLM equality included, ran.

Batch invariance itself is a property of the GPU code generation and is checked on a device by
scripts/gpu_check.sh; here the kernels' arithmetic is checked against float64 references through
the script's own dry run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_script_on_cpu_checks_the_kernels_and_is_incomplete_without_vllm(tmp_path):
    """Dry run on CPU: the kernels part runs and passes; the vLLM equality part cannot run here,
    so the overall result is INCOMPLETE (exit 2), never PASS."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "ZMRL_GPU_CHECK_DRY_RUN": "1", "OUT": str(tmp_path),
           "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--parts", "kernels_match_reference,vllm_bf16_equality"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = summary["parts"]["kernels_match_reference"]
    assert reference["status"] == "PASS", reference["details"]
    assert summary["parts"]["vllm_bf16_equality"]["status"] == "NOT RUN"
    assert summary["overall"] == "INCOMPLETE"
    assert "overall: INCOMPLETE" in proc.stdout and "overall: PASS" not in proc.stdout


@pytest.fixture
def gpu_check():
    from zero_mismatch_plugin.aligned import gpu_check

    return gpu_check


def _write_group(directory, group, statuses):
    parts = {name: {"status": status, "details": {}} for name, status in statuses.items()}
    (directory / f"{group}.json").write_text(json.dumps({"parts": parts, "environment": {}}))


def test_summary_is_incomplete_when_every_kernel_part_passed_but_vllm_did_not_run(gpu_check, tmp_path, capsys):
    kernels = {name: "PASS" for name in gpu_check.KERNEL_PARTS} | {"torch_default_ops": "INFO"}
    _write_group(tmp_path, "kernels", kernels)
    _write_group(tmp_path, "vllm", {gpu_check.VLLM_PART: "NOT RUN"})
    assert gpu_check.summarize(tmp_path)["overall"] == "INCOMPLETE"
    assert gpu_check.main(["--summarize", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "overall: INCOMPLETE" in out and "did not run: vllm_bf16_equality" in out
    # The same with the vLLM part passed: complete.
    _write_group(tmp_path, "vllm", {gpu_check.VLLM_PART: "PASS"})
    assert gpu_check.summarize(tmp_path)["overall"] == "PASS"
    assert gpu_check.main(["--summarize", str(tmp_path)]) == 0


def test_summary_fails_on_a_failed_crashed_or_timed_out_part(gpu_check, tmp_path):
    kernels = {name: "PASS" for name in gpu_check.KERNEL_PARTS}
    _write_group(tmp_path, "kernels", {**kernels, "linear_batch_invariant": "FAIL"})
    _write_group(tmp_path, "vllm", {gpu_check.VLLM_PART: "NOT RUN"})
    assert gpu_check.summarize(tmp_path)["overall"] == "FAIL"
    _write_group(tmp_path, "kernels", kernels)
    assert gpu_check.summarize(tmp_path, timed_out=["vllm"])["overall"] == "FAIL"
    (tmp_path / "vllm.json").unlink()  # the vLLM part crashed before writing anything
    summary = gpu_check.summarize(tmp_path)
    assert summary["overall"] == "FAIL" and summary["parts"]["vllm"]["status"] == "FAIL"


def test_a_missing_required_part_is_incomplete_even_if_all_others_passed(gpu_check):
    parts = {name: {"status": "PASS"} for name in gpu_check.required_parts(None)}
    assert gpu_check.overall_status(parts, gpu_check.required_parts(None)) == "PASS"
    del parts["attention_prefill_vs_decode"]
    assert gpu_check.overall_status(parts, gpu_check.required_parts(None)) == "INCOMPLETE"
    assert gpu_check.overall_status(parts, gpu_check.required_parts("vllm")) == "PASS"
