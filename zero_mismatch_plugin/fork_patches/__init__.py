"""``zmrl patches``: the upstream patches for a fork, their manifest, checking and applying.

The patches live in ``diffs/`` (also reachable as ``patches/`` at the top of a source
checkout) as ``git format-patch`` files, listed with their pinned upstream versions in
``diffs/manifest.yaml``. ``check`` never writes to the installed packages or to a checkout
it reports on, and ``apply --to`` writes a checkout only after every patch applied to a
staged copy of it (:mod:`.series`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from zero_mismatch_plugin.fork_patches.checkout import checkout_version, detect_upstream, resolve_version
from zero_mismatch_plugin.fork_patches.manifest import DIFFS_DIR, MANIFEST, Manifest, Patch, PatchError, Upstream, diff_targets, installed_root
from zero_mismatch_plugin.fork_patches.manifest import installed_version, load_manifest, touched_files
from zero_mismatch_plugin.fork_patches.series import ALREADY_APPLIED, APPLIES, APPLIES_WITH_OFFSETS, FAILS, apply_to, apply_to_copy
from zero_mismatch_plugin.fork_patches.series import WORK_DIR, ApplyInterrupted, check_checkout, copy_patched_package, run_patch
from zero_mismatch_plugin.fork_patches.verify import TOOLS, CheckResult, check_installed

__all__ = [
    "ALREADY_APPLIED", "APPLIES", "APPLIES_WITH_OFFSETS", "DIFFS_DIR", "FAILS", "MANIFEST", "WORK_DIR",
    "ApplyInterrupted", "CheckResult",
    "Manifest", "Patch", "PatchError", "Upstream", "apply_to", "apply_to_copy", "check_checkout",
    "check_installed", "checkout_version", "copy_patched_package", "detect_upstream", "diff_targets",
    "installed_root", "installed_version", "load_manifest", "resolve_version", "run_patch", "touched_files",
]


def list_command() -> int:
    manifest = load_manifest()
    print(f"patches in {DIFFS_DIR} (apply in this order: `git am -3`, or `patch -p1` from the checkout root):")
    for patch in manifest.patches:
        spec = manifest.upstreams[patch.upstream]
        print(f"  {patch.name}  [{spec.distribution} {', '.join(patch.versions)}]")
        print(f"      {patch.purpose}")
        print(f"      patch: {patch.diff}; files: {', '.join(patch.files)}")
        print(f"      test: {patch.test}")
    return 0


def _fail(error: Exception) -> int:
    print(f"ERROR: {error}", file=sys.stderr)
    return 1


def check_command(directory: str | None = None, upstream: str | None = None) -> int:
    if directory is not None:
        return check_checkout_command(directory, upstream)
    if upstream is not None:
        return _fail(PatchError("--upstream goes with --to DIR; without --to every upstream is checked"))
    manifest = load_manifest()
    results = check_installed(manifest)
    for result in results:
        spec = manifest.upstreams[result.patch.upstream]
        status = "ok  " if result.ok else "FAIL"
        print(f"{status} {result.patch.name} ({spec.distribution} {result.version or 'not installed'}): "
              f"{result.detail}")
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} of {len(results)} patches apply to the installed upstream packages "
          f"with {TOOLS} (nothing installed was modified)")
    return 1 if failed else 0


def check_checkout_command(directory: str, upstream: str | None) -> int:
    try:
        report = check_checkout(Path(directory), upstream)
    except PatchError as error:
        return _fail(error)
    print(f"{report.root}: {report.upstream} {report.version}; the patches were made for {', '.join(report.pinned)}")
    width = max(len(s.patch.name) for s in report.states)
    for state in report.states:
        print(f"  {state.patch.name:<{width}}  {state.describe()}")
    if report.interrupted:
        print(f"NOTE: an interrupted `zmrl patches apply` left {report.root / WORK_DIR}, and the states above are "
              f"of a partly written checkout: `zmrl patches apply --to {report.root}` puts its files back first")
    failing = sum(s.status == FAILS for s in report.states)
    print(f"{len(report.states) - failing} of {len(report.states)} patches apply or are already applied "
          f"(nothing in {report.root} was modified)")
    return 1 if failing else 0


def apply_command(directory: str, upstream: str | None, assume_version: str | None) -> int:
    try:
        result = apply_to(Path(directory), upstream, assume_version)
    except PatchError as error:
        return _fail(error)
    except ApplyInterrupted as stop:
        print(f"ERROR: {stop}", file=sys.stderr)
        return 130
    if result.recovered:
        print(f"put back {', '.join(result.recovered)}: an earlier apply was interrupted after writing them")
    for state in result.states:
        if state.status == ALREADY_APPLIED:
            print(f"already applied {state.patch.name}: left as it is")
        else:
            print(f"applied {state.patch.name}: {', '.join(state.patch.files)}"
                  + (f" ({'; '.join(state.where)})" if state.where else ""))
    if not result.applied:
        print(f"every {result.upstream} patch is already applied to {directory}; nothing was changed")
    return 0
