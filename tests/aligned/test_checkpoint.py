"""Copying a checkpoint into a trainer's parameters (both faces use it): exact names and shapes."""

from __future__ import annotations

import pytest
import torch

from zero_mismatch_plugin.aligned.checkpoint import copy_checkpoint, read_checkpoint


def _params():
    return {"a": torch.nn.Parameter(torch.zeros(2, 3)), "b": torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))}


def test_copies_by_name_in_each_parameters_dtype():
    params = _params()
    state = {"a": torch.ones(2, 3, dtype=torch.bfloat16), "b": torch.arange(3.0), "x.rotary_emb": torch.ones(1)}
    copy_checkpoint(params, state, ignored=("rotary_emb",))
    assert torch.equal(params["a"], torch.ones(2, 3)) and params["b"].dtype == torch.float64
    assert torch.equal(params["b"], torch.arange(3.0, dtype=torch.float64))


@pytest.mark.parametrize(
    "state, message",
    [
        ({"a": torch.ones(2, 3)}, r"missing \['b'\]"),
        ({"a": torch.ones(2, 3), "b": torch.ones(3), "c": torch.ones(1)}, r"unexpected \['c'\]"),
        # Broadcastable, so a plain copy_ would have filled every row with it.
        ({"a": torch.ones(1, 3), "b": torch.ones(3)}, r"a: checkpoint \(1, 3\) vs model \(2, 3\)"),
    ],
)
def test_refuses_what_does_not_match(state, message):
    with pytest.raises(ValueError, match=message):
        copy_checkpoint(_params(), state)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors files"):
        read_checkpoint(tmp_path)
