"""Applying an upstream's patch series to a checkout: stage every file, then write, all or nothing.

Every patch is first tried, in manifest order, on a staging copy of the files the series
touches; the checkout is written only when none of them fails, and a write that fails
midway puts back what was already written.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .checkout import checkout_version, detect_upstream, require_checkout_of, require_directory, resolve_version
from .formatpatch import index_lines
from .manifest import Manifest, Patch, PatchError, installed_root, load_manifest, touched_files
from .tools import PatchRun, ToolMissing, has_object, is_git_work_tree, run_patch_program

APPLIES = "applies"
APPLIES_WITH_OFFSETS = "applies with offsets"
ALREADY_APPLIED = "already applied"
FAILS = "fails"


@dataclass(frozen=True)
class PatchState:
    """What one patch does to a checkout, and where (moved or failing hunks, missing files)."""

    patch: Patch
    status: str
    where: tuple[str, ...] = ()
    note: str = ""

    def describe(self) -> str:
        text = self.status
        if self.where:
            text += ": " + "; ".join(self.where)
        return text + (f" ({self.note})" if self.note else "")


# ----- running patch on staged copies ---------------------------------------------------------


def run_patch(patch: Patch, root: Path, dry_run: bool = False) -> PatchRun:
    """Apply one patch under ``root`` with no fuzz; raise :class:`PatchError` when it does not apply."""
    try:
        run = run_patch_program(patch.diff_path, root, dry_run=dry_run)
    except ToolMissing as error:
        raise PatchError(str(error)) from error
    if not run.ok:
        raise PatchError(f"{patch.name} does not apply under {root}:\n{run.output}")
    return run


def copy_existing(relatives: list[str], source_root: Path, destination: Path) -> None:
    for relative in relatives:
        source = source_root / relative
        if source.is_file():
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


def _why_it_fails(patch: Patch, staging: Path) -> PatchState:
    # Every hunk tried both ways: hunks that fail forward but reverse cleanly, while the
    # others do the opposite, mean the patch was partly applied by hand.
    forward = run_patch_program(patch.diff_path, staging, dry_run=True, every_hunk=True)
    backward = run_patch_program(patch.diff_path, staging, dry_run=True, reverse=True, every_hunk=True)
    failed_forward = {(h.path, h.number) for h in forward.failed}
    failed_backward = {(h.path, h.number) for h in backward.failed}
    if failed_forward and failed_backward and not failed_forward & failed_backward:
        where = tuple(f"{h.path}:{h.line} (hunk {h.number} is already there)" for h in forward.failed)
        return PatchState(patch, FAILS, where, "the rest of the patch is not: revert the part that is there, "
                                               "then apply again")
    where = tuple(h.describe() for h in forward.failed) or tuple(forward.output.splitlines()[-1:])
    return PatchState(patch, FAILS, where, "the code there differs from the version the patch was made for")


def classify(patch: Patch, root: Path, staging: Path) -> PatchState:
    """Try ``patch`` on the staged files; apply it there when it applies. ``root``: the checkout."""
    missing = [relative for relative in patch.files if not (root / relative).is_file()]
    if missing:
        return PatchState(patch, FAILS, tuple(f"{relative}: no such file in the checkout" for relative in missing))
    forward = run_patch_program(patch.diff_path, staging, dry_run=True)
    if forward.ok:
        run_patch(patch, staging)
        moved = tuple(h.describe() for h in forward.moved)
        return PatchState(patch, APPLIES_WITH_OFFSETS if moved else APPLIES, moved)
    if run_patch_program(patch.diff_path, staging, dry_run=True, reverse=True).ok:
        return PatchState(patch, ALREADY_APPLIED)
    return _why_it_fails(patch, staging)


def stage_series(patches: list[Patch], root: Path, staging: Path) -> list[PatchState]:
    """Copy the files ``patches`` touch from ``root`` into ``staging`` and try them there in order."""
    copy_existing(touched_files(patches), root, staging)
    try:
        return [classify(patch, root, staging) for patch in patches]
    except ToolMissing as error:
        raise PatchError(str(error)) from error


def apply_to_copy(patches: list[Patch], source_root: Path, destination: Path) -> Path:
    """Copy the files ``patches`` touch from ``source_root`` to ``destination`` and apply them there."""
    relatives = touched_files(patches)
    for relative in relatives:
        if not (source_root / relative).is_file():
            raise PatchError(f"{source_root}: has no {relative}")
    copy_existing(relatives, source_root, destination)
    for patch in patches:
        run_patch(patch, destination)
    return destination


def copy_patched_package(manifest: Manifest, upstream: str, destination: Path) -> Path:
    """A full copy of the installed package of ``upstream`` under ``destination``, every patch applied.

    For tests and experiments: import from ``destination`` to run the patched upstream.
    """
    spec = manifest.upstreams[upstream]
    root = installed_root(spec)
    shutil.copytree(root / spec.package, destination / spec.package,
                    ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    for patch in manifest.for_upstream(upstream):
        run_patch(patch, destination)
    return destination


# ----- writing the checkout ------------------------------------------------------------------


def write_file(path: Path, data: bytes) -> None:
    """Overwrite one file of the checkout in place (its permissions stay as they are)."""
    path.write_bytes(data)


def _restore(root: Path, originals: dict[str, bytes]) -> list[str]:
    """Put the original bytes back into every file in ``originals``; the ones that could not be."""
    left = []
    for relative, data in originals.items():
        target = root / relative
        try:
            if target.read_bytes() != data:
                write_file(target, data)
        except OSError as error:
            left.append(f"{relative} ({error})")
    return left


def write_staged(root: Path, staging: Path, relatives: list[str]) -> list[str]:
    """Copy the staged files that changed into the checkout; on a failed write, restore them all."""
    changed = {}
    for relative in relatives:
        staged, current = (staging / relative).read_bytes(), (root / relative).read_bytes()
        if staged != current:
            changed[relative] = (current, staged)
    originals: dict[str, bytes] = {}
    for relative, (current, staged) in changed.items():
        originals[relative] = current  # before the write: a failed write may have truncated it
        try:
            write_file(root / relative, staged)
        except OSError as error:
            left = _restore(root, originals)
            if left:
                raise PatchError(f"could not write {root / relative} ({error}), and could not restore "
                                 f"{', '.join(left)}: restore them from version control") from error
            raise PatchError(f"could not write {root / relative} ({error}); the files written before it "
                             "were restored, so the checkout is as it was. Fix the cause and run again.") from error
    return list(changed)


# ----- apply --to ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyResult:
    upstream: str
    version: str
    states: tuple[PatchState, ...]

    @property
    def applied(self) -> list[Patch]:
        return [s.patch for s in self.states if s.status in (APPLIES, APPLIES_WITH_OFFSETS)]

    @property
    def already_applied(self) -> list[Patch]:
        return [s.patch for s in self.states if s.status == ALREADY_APPLIED]


def series_for(manifest: Manifest, root: Path, upstream: str | None) -> tuple[str, list[Patch]]:
    """The upstream of the checkout at ``root`` (``upstream`` when given) and its patch series."""
    upstream = upstream or detect_upstream(root)
    manifest.upstream(upstream)
    require_checkout_of(upstream, root)
    patches = manifest.for_upstream(upstream)
    if not patches:
        raise PatchError(f"no patches for {upstream}")
    return upstream, patches


def apply_to(root: Path, upstream: str | None = None, assume_version: str | None = None,
             manifest: Manifest | None = None, warn: Callable[[str], None] | None = None) -> ApplyResult:
    """Apply every patch for the upstream checked out at ``root``; all or nothing.

    Patches already present are left alone (a second run changes nothing); any patch that
    neither applies nor is present stops the run before the checkout is written.
    """
    manifest = manifest or load_manifest()
    root = require_directory(Path(root))
    upstream, patches = series_for(manifest, root, upstream)
    version = resolve_version(upstream, root, assume_version, warn)
    refused = [p.name for p in patches if version not in p.versions]
    if refused:
        made_for = sorted({v for p in patches for v in p.versions})
        raise PatchError(f"{root} is {upstream} {version}; the patches were made for {', '.join(made_for)} "
                         f"(refused: {', '.join(refused)}). Nothing was changed. "
                         f"`zmrl patches check --to {root}` shows what would apply.")
    with tempfile.TemporaryDirectory(prefix=f"zmrl-apply-{upstream}-") as tmp:
        states = stage_series(patches, root, Path(tmp))
        failing = [s for s in states if s.status == FAILS]
        if failing:
            lines = "\n".join(f"  {s.patch.name}: {s.describe()}" for s in failing)
            raise PatchError(f"{root}: not every {upstream} patch applies, so nothing was changed:\n{lines}")
        write_staged(root, Path(tmp), touched_files(patches))
    return ApplyResult(upstream, version, tuple(states))


# ----- check --to ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckoutReport:
    root: Path
    upstream: str
    version: str  # as stated, or why it is unknown
    pinned: tuple[str, ...]
    states: tuple[PatchState, ...]

    @property
    def ok(self) -> bool:
        return all(s.status != FAILS for s in self.states)


def _stated_version(upstream: str, root: Path) -> str:
    try:
        return checkout_version(upstream, root) or "version not stated"
    except PatchError as error:
        return f"version unreadable: {error}"


def _with_three_way_note(state: PatchState, root: Path) -> PatchState:
    """For a patch that does not apply cleanly: can ``git am -3`` fall back to a three-way merge here?"""
    if state.status not in (FAILS, APPLIES_WITH_OFFSETS):
        return state
    blobs = [line.old for line in index_lines(state.patch.diff_path.read_text(encoding="utf-8"))]
    if all(has_object(root, blob) for blob in blobs):
        note = "the repository holds the pinned files, so `git am -3` can try a three-way merge"
    else:
        note = "the repository lacks the pinned files' blobs, so `git am -3` cannot fall back to a three-way merge"
    return PatchState(state.patch, state.status, state.where, "; ".join(filter(None, (state.note, note))))


def check_checkout(root: Path, upstream: str | None = None, manifest: Manifest | None = None) -> CheckoutReport:
    """What each patch would do to the checkout at ``root`` (any version); ``root`` is not written."""
    manifest = manifest or load_manifest()
    root = require_directory(Path(root))
    upstream, patches = series_for(manifest, root, upstream)
    with tempfile.TemporaryDirectory(prefix=f"zmrl-check-{upstream}-") as tmp:
        states = stage_series(patches, root, Path(tmp))
    if is_git_work_tree(root):
        states = [_with_three_way_note(state, root) for state in states]
    pinned = tuple(sorted({v for p in patches for v in p.versions}))
    return CheckoutReport(root, upstream, _stated_version(upstream, root), pinned, tuple(states))
