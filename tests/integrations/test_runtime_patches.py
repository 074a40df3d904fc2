"""The plugin's one runtime patch mechanism: version gate, post-import application, exact
removal, listing."""

from __future__ import annotations

import sys

import pytest
import torch

from zero_mismatch_plugin.integrations import patches as runtime_patches


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


def _planted_hooks_module(tmp_path, monkeypatch, name: str) -> str:
    (tmp_path / f"{name}.py").write_text("HOOKS = {'step': []}\nPROCESSORS = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _hook(module_name: str, key: str | None, function) -> runtime_patches.HookRegistration:
    return runtime_patches.HookRegistration(
        name=f"planted-{key}", package="torch", versions=(torch.__version__,), module=module_name,
        attribute="HOOKS" if key else "PROCESSORS", key=key, function=function, why="test")


def test_hook_registration_waits_for_its_module_and_is_taken_out_again(tmp_path, monkeypatch):
    name = _planted_hooks_module(tmp_path, monkeypatch, "zmrl_planted_hooks")
    try:
        step, processor = _hook(name, "step", print), _hook(name, None, repr)
        runtime_patches.apply(step)
        runtime_patches.apply(processor)
        assert runtime_patches.is_pending(step) and name not in sys.modules
        import zmrl_planted_hooks

        assert zmrl_planted_hooks.HOOKS == {"step": [print]} and zmrl_planted_hooks.PROCESSORS == [repr]
        assert {"planted-step", "planted-None"} <= set(runtime_patches.applied())
        runtime_patches.apply(step)  # again: still one entry
        assert zmrl_planted_hooks.HOOKS == {"step": [print]}
        runtime_patches.remove(step)
        runtime_patches.remove(processor)
        assert zmrl_planted_hooks.HOOKS == {"step": []} and zmrl_planted_hooks.PROCESSORS == []
        assert not runtime_patches.is_applied(step) and not runtime_patches.is_applied(processor)
    finally:
        sys.modules.pop(name, None)


def test_a_second_patch_of_a_held_target_is_refused(planted_module):
    import zmrl_planted_target

    first = _doubling_patch(planted_module)
    second = runtime_patches.FunctionPatch(**{**first.__dict__, "name": "planted-again"})
    runtime_patches.apply(first)
    try:
        with pytest.raises(RuntimeError, match="already patched by 'planted'"):
            runtime_patches.apply(second)
        assert zmrl_planted_target.answer(1) == 2
    finally:
        runtime_patches.remove(first)
    assert zmrl_planted_target.answer(1) == 1


# ----- the plugin's registry -------------------------------------------------------------------


def _modules_defining_patches() -> list[str]:
    """Every module of the package whose source builds a patch of the mechanism."""
    from pathlib import Path

    import zero_mismatch_plugin

    root = Path(zero_mismatch_plugin.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "integrations" / "patches.py":  # the mechanism itself
            continue
        text = path.read_text()
        if "FunctionPatch" in text or "HookRegistration" in text:
            parts = path.relative_to(root.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _patches_in(module) -> list:
    found = []
    for value in vars(module).values():
        values = value if isinstance(value, (list, tuple)) else [value]
        found.extend(v for v in values if isinstance(v, (runtime_patches.FunctionPatch, runtime_patches.HookRegistration)))
    return found


def test_registry_lists_every_runtime_patch_of_the_plugin():
    import importlib

    registered = [patch for _, patch in runtime_patches.registered()]
    modules = _modules_defining_patches()
    # The three groups at least; a new module with patches is found here too.
    assert {"zero_mismatch_plugin.integrations.vllm.plugin", "zero_mismatch_plugin.integrations.verl.megatron_engine",
            "zero_mismatch_plugin.integrations.verl.cpu.patches"} <= set(modules), modules
    defined = [patch for name in modules for patch in _patches_in(importlib.import_module(name))]
    missing = sorted({patch.name for patch in defined if patch not in registered})
    assert not missing, f"patches missing from integrations.patches.REGISTRY: {missing}"
    names = [patch.name for patch in registered]
    assert len(names) == len(set(names)), names
    assert {patch.package for patch in registered} == {"vllm", "verl", "megatron.core", "mbridge"}
    for patch in registered:
        info = runtime_patches.describe(patch)
        assert all(info[key] for key in ("name", "package", "versions", "target", "why")), info
    print(f"{len(registered)} runtime patches in {len(runtime_patches.REGISTRY)} groups")


def test_patches_list_shows_the_runtime_patches_next_to_the_fork_patches(capsys):
    from zero_mismatch_plugin.tools.cli import main

    assert main(["patches", "list"]) == 0
    out = capsys.readouterr().out
    fork, runtime = out.split("runtime patches")
    assert "verl-megatron-engine-hooks" in fork
    for group, patch in runtime_patches.registered():
        assert group in runtime
        assert f"{patch.name}  [{patch.package} {', '.join(patch.versions)}]  {patch.target}" in runtime
        assert patch.why in runtime


@pytest.mark.parametrize("package", ["vllm", "verl", "megatron.core"])
def test_every_patch_refuses_a_planted_other_version_of_its_package(package, monkeypatch):
    import importlib

    patches = [patch for _, patch in runtime_patches.registered() if patch.package == package]
    assert patches
    # An engine started earlier in this process may have applied some already (applying again is
    # then a no-op, not a version check): take them out for the test and put them back after.
    active = [p for p in patches if runtime_patches.is_applied(p) or runtime_patches.is_pending(p)]
    for patch in active:
        runtime_patches.remove(patch)
    try:
        monkeypatch.setattr(importlib.import_module(package), "__version__", "0.0.1")
        for patch in patches:
            with pytest.raises(runtime_patches.UnsupportedVersion, match=f"found {package} 0.0.1"):
                runtime_patches.apply(patch)
            assert not runtime_patches.is_applied(patch) and not runtime_patches.is_pending(patch), patch.name
    finally:
        monkeypatch.undo()
        for patch in active:
            runtime_patches.apply(patch)
