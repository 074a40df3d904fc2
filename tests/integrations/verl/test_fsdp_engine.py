"""The verl FSDP-engine patch: verl's micro-batch in the packed layout, the engine settings it
refuses, applied and undone exactly, version-gated, switched by the environment. The aligned
forward it runs is tested in tests/faces/fsdp."""

from __future__ import annotations

import types

import pytest
import torch

from zero_mismatch_plugin.faces.fsdp import UnsupportedFSDPFeature
from zero_mismatch_plugin.integrations.verl import fsdp_engine


def test_packed_micro_batch_reads_verls_jagged_layout():
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    ids = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    micro_batch = TensorDict({
        "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
        "position_ids": torch.nested.as_nested_tensor([torch.arange(3), torch.arange(2)], layout=torch.jagged),
        "temperature": torch.tensor([0.5, 1.0]),
    }, batch_size=[2])
    tu.assign_non_tensor(micro_batch, use_remove_padding=False)
    packed = fsdp_engine.packed_micro_batch(micro_batch)
    assert packed.seq_lens == [3, 2]
    assert packed.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert packed.positions.tolist() == [0, 1, 2, 0, 1]
    # verl's labels: the next token of the packed stream (a sequence's last row is never read).
    assert packed.labels.tolist() == [6, 7, 8, 9, 5]
    assert packed.temperature.tolist() == [0.5, 0.5, 0.5, 1.0, 1.0]


def test_unsupported_engine_settings_are_refused_naming_the_fix():
    engine = types.SimpleNamespace(_is_lora=True, ulysses_sequence_parallel_size=2, _qat_enabled=False,
                                   engine_config=types.SimpleNamespace(strategy="fsdp2"),
                                   model_config=types.SimpleNamespace(lora={"merge": True}))
    with pytest.raises(UnsupportedFSDPFeature) as error:
        fsdp_engine.check_engine_supported(engine)
    message = str(error.value)
    assert "lora.merge=false" in message and "ulysses_sequence_parallel_size=1" in message
    assert fsdp_engine.ENABLE_ENV in message


def test_patch_is_reversible_and_version_gated(monkeypatch):
    import verl
    from verl.workers.engine.fsdp import transformer_impl as ti

    from zero_mismatch_plugin.integrations.patches import UnsupportedVersion, applied

    originals = (ti.FSDPEngineWithLMHead.__dict__["forward_step"], ti.FSDPEngine.__dict__["optimizer_step"],
                 ti.FSDPEngine.__dict__["load_checkpoint"])
    fsdp_engine.apply()
    try:
        assert {patch.name for patch in fsdp_engine.PATCHES} <= set(applied())
        assert ti.FSDPEngineWithLMHead.forward_step is not originals[0]
        assert ti.FSDPEngineWithLMHead.forward_step.__wrapped__ is originals[0]
    finally:
        fsdp_engine.remove()
    assert (ti.FSDPEngineWithLMHead.__dict__["forward_step"], ti.FSDPEngine.__dict__["optimizer_step"],
            ti.FSDPEngine.__dict__["load_checkpoint"]) == originals
    monkeypatch.setattr(verl, "__version__", "0.9.0")
    with pytest.raises(UnsupportedVersion, match="0.9.0"):
        fsdp_engine.apply()
    assert not fsdp_engine.is_active()


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(fsdp_engine.ENABLE_ENV, raising=False)
    assert not fsdp_engine.maybe_apply()
    monkeypatch.setenv(fsdp_engine.ENABLE_ENV, "1")
    try:
        assert fsdp_engine.maybe_apply() and fsdp_engine.is_active()
    finally:
        fsdp_engine.remove()
