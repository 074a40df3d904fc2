"""The plugin's one runtime patch mechanism: version gate, post-import application, exact
removal, listing."""

from __future__ import annotations

import sys

import pytest
import torch

from zero_mismatch_plugin import runtime_patches


@pytest.fixture
def planted_module(tmp_path, monkeypatch):
    """A module not imported yet, with one function to patch."""
    (tmp_path / "zmrl_planted_target.py").write_text("def answer(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "zmrl_planted_target"
    sys.modules.pop("zmrl_planted_target", None)


def _doubling_patch(module_name: str) -> runtime_patches.FunctionPatch:
    def build(original):
        def answer(x):
            return 2 * original(x)
        return answer

    return runtime_patches.FunctionPatch(name="planted", package="torch", versions=(torch.__version__,),
                                 module=module_name, owner=None, attribute="answer", build=build,
                                 why="test")


def test_patch_waits_for_its_module_and_applies_when_it_is_imported(planted_module):
    patch = _doubling_patch(planted_module)
    runtime_patches.apply(patch)
    try:
        assert runtime_patches.is_pending(patch) and planted_module not in sys.modules
        from zmrl_planted_target import answer  # bound by name right after the module runs

        assert answer(3) == 6 and runtime_patches.is_applied(patch)
    finally:
        runtime_patches.remove(patch)
    assert sys.modules[planted_module].answer(3) == 3
    assert not runtime_patches.is_applied(patch) and not runtime_patches.is_pending(patch)


def test_patch_of_an_imported_module_applies_at_once_and_rebinds_importers(planted_module, monkeypatch):
    import zmrl_planted_target

    importer = type(sys)("zmrl_planted_importer")
    importer.answer = zmrl_planted_target.answer
    monkeypatch.setitem(sys.modules, "zmrl_planted_importer", importer)
    patch = runtime_patches.FunctionPatch(**{**_doubling_patch(planted_module).__dict__,
                                     "bound_in": ("zmrl_planted_importer",)})
    runtime_patches.apply(patch)
    try:
        assert zmrl_planted_target.answer(2) == 4 and importer.answer(2) == 4
    finally:
        runtime_patches.remove(patch)
    assert zmrl_planted_target.answer(2) == 2 and importer.answer(2) == 2


def test_an_unsupported_version_is_refused_before_anything_changes(planted_module):
    patch = runtime_patches.FunctionPatch(**{**_doubling_patch(planted_module).__dict__, "versions": ("0.0.1",)})
    with pytest.raises(runtime_patches.UnsupportedVersion, match=r"supports torch 0\.0\.1; found torch "):
        runtime_patches.apply(patch)
    assert not runtime_patches.is_pending(patch) and "planted" not in runtime_patches.pending()
    from zmrl_planted_target import answer

    assert answer(3) == 3


def test_applied_lists_patches_by_name_and_remove_is_idempotent(planted_module):
    import zmrl_planted_target

    patch = _doubling_patch(planted_module)
    runtime_patches.apply(patch)
    runtime_patches.apply(patch)  # twice: still one wrapper
    try:
        assert "planted" in runtime_patches.applied() and zmrl_planted_target.answer(1) == 2
    finally:
        runtime_patches.remove(patch)
    runtime_patches.remove(patch)
    assert "planted" not in runtime_patches.applied() and zmrl_planted_target.answer(1) == 1
