"""``zmrl patches check``: every patch against the installed pinned upstream, with every tool a fork uses.

Applies each series to copies of the installed files with ``patch -p1``, ``git apply`` and
``git am -3``; the results must be the same bytes and the ``index`` lines must name the right
blobs. See docs/patches.md, "Checking the set: check".
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from zero_mismatch_plugin.fork_patches.formatpatch import blob_id, index_lines
from zero_mismatch_plugin.fork_patches.manifest import (
    Manifest,
    Patch,
    installed_file_differs_from_record,
    installed_root,
    installed_version,
    touched_files,
)
from zero_mismatch_plugin.fork_patches.series import copy_existing
from zero_mismatch_plugin.fork_patches.tools import git_am, git_apply, init_repository, run_patch_program

TOOLS = "patch -p1, git apply and git am -3"


@dataclass(frozen=True)
class CheckResult:
    patch: Patch
    version: str | None
    ok: bool
    detail: str


def _blob_mismatch(patch: Patch, tree: Path, side: str) -> str | None:
    """Why ``tree`` does not hold the blobs the patch names on ``side`` ("old" / "new"), or None."""
    lines = index_lines(patch.diff_path.read_text(encoding="utf-8"))
    if sorted(line.path for line in lines) != sorted(patch.files):
        return f"its index lines cover {sorted(line.path for line in lines)}, not {sorted(patch.files)}"
    for line in lines:
        expected = line.old if side == "old" else line.new
        actual = blob_id((tree / line.path).read_bytes())
        if actual != expected:
            return (f"its index line names {side} blob {expected[:12]} for {line.path}, the file "
                    f"{'before' if side == 'old' else 'after'} it is {actual[:12]}: regenerate the patches")
    return None


def _check_one(patch: Patch, trees: dict[str, Path]) -> str | None:
    """Apply ``patch`` in each tree (the next of its series); why it failed, or None."""
    plain = trees["patch"]
    mismatch = _blob_mismatch(patch, plain, "old")
    if mismatch:
        return mismatch
    run = run_patch_program(patch.diff_path, plain)
    if not run.ok:
        return f"patch -p1 fails: {run.output}"
    applied, output = git_apply(patch.diff_path, trees["git apply"])
    if not applied:
        return f"git apply fails: {output}"
    applied, output = git_am(patch.diff_path, trees["git am -3"], three_way=True)
    if not applied:
        return f"git am -3 fails: {output}"
    mismatch = _blob_mismatch(patch, plain, "new")
    if mismatch:
        return mismatch
    for tool in ("git apply", "git am -3"):
        differing = [f for f in patch.files if (trees[tool] / f).read_bytes() != (plain / f).read_bytes()]
        if differing:
            return f"{tool} gives other bytes than patch -p1 for {', '.join(differing)}"
    return None


def _record_mismatches(spec, relatives: list[str]) -> list[str]:
    return [why for why in (installed_file_differs_from_record(spec, r) for r in relatives) if why]


def _check_series(manifest: Manifest, name: str, version: str) -> list[CheckResult]:
    spec, patches = manifest.upstreams[name], manifest.for_upstream(name)
    root = installed_root(spec)
    relatives = touched_files(patches)
    missing = [r for r in relatives if not (root / r).is_file()]
    if missing:
        return [CheckResult(p, version, False, f"{root} has no {', '.join(missing)}") for p in patches]
    modified = _record_mismatches(spec, relatives)
    if modified:
        return [CheckResult(p, version, False, "; ".join(modified)) for p in patches]
    results = []
    with tempfile.TemporaryDirectory(prefix=f"zmrl-patches-{name}-") as tmp:
        trees = {tool: Path(tmp) / tool.replace(" ", "-") for tool in ("patch", "git apply", "git am -3")}
        for tree in trees.values():
            copy_existing(relatives, root, tree)
        init_repository(trees["git apply"], f"{spec.distribution} {version}")
        init_repository(trees["git am -3"], f"{spec.distribution} {version}")
        # In manifest order on the same trees, as a fork applies the series.
        for patch in patches:
            if version not in patch.versions:
                results.append(CheckResult(patch, version, False, f"made for {spec.distribution} "
                                           f"{', '.join(patch.versions)}; installed is {version}"))
                continue
            failure = _check_one(patch, trees)
            results.append(CheckResult(patch, version, failure is None, failure or f"applies with {TOOLS}"))
    return results


def check_installed(manifest: Manifest) -> list[CheckResult]:
    """Apply each upstream's series, in order, to copies of the installed files of that upstream."""
    results = []
    for name, spec in manifest.upstreams.items():
        patches = manifest.for_upstream(name)
        if not patches:
            continue
        version = installed_version(spec)
        if version is None:
            results += [CheckResult(p, None, False, f"{spec.distribution} is not installed") for p in patches]
            continue
        try:
            results += _check_series(manifest, name, version)
        except RuntimeError as error:  # PatchError, ToolMissing, or a git command that failed
            results += [CheckResult(p, version, False, str(error)) for p in patches]
    return results
