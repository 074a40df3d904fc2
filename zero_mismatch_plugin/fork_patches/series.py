"""Applying an upstream's patch series to a checkout: stage every file, then write, all or nothing.

Every patch is first tried, in manifest order, on a staging copy of the files the series
touches; the checkout is written only when none of them fails and every file can be written
inside it, through :mod:`.checkout_writes` (atomic writes, a journal a killed run is undone from).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zero_mismatch_plugin.fork_patches.checkout_writes import (
    WORK_DIR,
    ApplyInterrupted,
    Change,
    check_targets,
    checkout_lock,
    journal_path,
    make_work_dir,
    recover_interrupted,
    remove_work_dir,
    staged_changes,
    termination_interrupts,
    write_changes,
    write_hint,
    write_journal,
)
from zero_mismatch_plugin.fork_patches.checkout import checkout_version, detect_upstream, require_checkout_of, require_directory, resolve_version
from zero_mismatch_plugin.fork_patches.formatpatch import index_lines
from zero_mismatch_plugin.fork_patches.manifest import Manifest, Patch, PatchError, installed_root, load_manifest, touched_files
from zero_mismatch_plugin.fork_patches.tools import PatchRun, ToolMissing, has_object, is_git_work_tree, run_patch_program

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


def _not_a_file(root: Path, relative: str) -> str:
    path = root / relative
    if path.is_dir():
        return (f"{relative} is a directory in the checkout, where the patch changes a file: move the directory "
                "away and restore the file from the upstream repository")
    if path.is_symlink():
        return f"{relative} is a symbolic link to {os.readlink(path)}, which does not exist: restore the file"
    return f"{relative}: no such file in the checkout"


def _crlf_state(patch: Patch, staging: Path) -> PatchState | None:
    """``patch`` fails because files of it have CRLF line endings (the patches are LF): which, and what to do."""
    where, files = [], []
    for relative in patch.files:
        data = (staging / relative).read_bytes()
        crlf, lines = data.count(b"\r\n"), data.count(b"\n")
        if crlf:
            where.append(f"{relative} has CRLF line endings ({crlf} of {lines} lines); the patch expects LF")
            files.append(relative)
    if not files:
        return None
    named = " ".join(files)
    return PatchState(patch, FAILS, tuple(where),
                      f"convert to LF from the checkout root: `dos2unix {named}` (or `sed -i 's/\\r$//' {named}`); "
                      "if git wrote them so (core.autocrlf=true), run `git config core.autocrlf input` and check "
                      f"them out again: `rm {named} && git checkout -- {named}`")


def classify(patch: Patch, root: Path, staging: Path) -> PatchState:
    """Try ``patch`` on the staged files; apply it there when it applies. ``root``: the checkout."""
    missing = [relative for relative in patch.files if not (root / relative).is_file()]
    if missing:
        return PatchState(patch, FAILS, tuple(_not_a_file(root, relative) for relative in missing))
    forward = run_patch_program(patch.diff_path, staging, dry_run=True)
    if forward.ok:
        run_patch(patch, staging)
        moved = tuple(h.describe() for h in forward.moved)
        return PatchState(patch, APPLIES_WITH_OFFSETS if moved else APPLIES, moved)
    if run_patch_program(patch.diff_path, staging, dry_run=True, reverse=True).ok:
        return PatchState(patch, ALREADY_APPLIED)
    return _crlf_state(patch, staging) or _why_it_fails(patch, staging)


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

# ----- apply --to ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyResult:
    upstream: str
    version: str
    states: tuple[PatchState, ...]
    recovered: tuple[str, ...] = ()  # files an earlier, interrupted apply had written, put back first

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


def _prepare(root: Path, work: Path, upstream: str, patches: list[Patch]) -> tuple[list[PatchState], list[Change]]:
    """Stage the series in ``work``; refuse unless every patch and every write can succeed; back up and journal."""
    staging = work / "staging"
    staging.mkdir()
    states = stage_series(patches, root, staging)
    failing = [s for s in states if s.status == FAILS]
    if failing:
        lines = "\n".join(f"  {s.patch.name}: {s.describe()}" for s in failing)
        raise PatchError(f"{root}: not every {upstream} patch applies, so nothing was changed:\n{lines}")
    changes = staged_changes(root, staging, touched_files(patches))
    check_targets(root, changes)
    if changes:
        write_journal(root, work, changes)
    return states, changes


def apply_to(root: Path, upstream: str | None = None, assume_version: str | None = None,
             manifest: Manifest | None = None, warn: Callable[[str], None] | None = None) -> ApplyResult:
    """Apply every patch for the upstream checked out at ``root``; all or nothing.

    Patches already present are left alone (a second run changes nothing); any patch that
    neither applies nor is present stops the run before the checkout is written. What a killed
    run had written is put back first, from the journal it keeps in ``root/.zmrl-apply``.
    """
    manifest = manifest or load_manifest()
    root = require_directory(Path(root))
    upstream, patches = series_for(manifest, root, upstream)
    with checkout_lock(root), termination_interrupts():
        try:
            recovered = recover_interrupted(root)
        except KeyboardInterrupt as stop:
            raise ApplyInterrupted(f"interrupted while putting back the files an earlier, interrupted apply had "
                                   f"written: run `zmrl patches apply --to {root}` again to finish") from stop
        version = resolve_version(upstream, root, assume_version, warn)
        refused = [p.name for p in patches if version not in p.versions]
        if refused:
            made_for = sorted({v for p in patches for v in p.versions})
            raise PatchError(f"{root} is {upstream} {version}; the patches were made for {', '.join(made_for)} "
                             f"(refused: {', '.join(refused)}). Nothing was changed. "
                             f"`zmrl patches check --to {root}` shows what would apply.")
        work = make_work_dir(root)
        try:
            states, changes = _prepare(root, work, upstream, patches)
        except KeyboardInterrupt as stop:
            remove_work_dir(work)
            raise ApplyInterrupted(f"interrupted before any file of {root} was written; nothing was changed") from stop
        except OSError as error:
            remove_work_dir(work)
            hint = write_hint(error, Path(error.filename or work / "staging"))
            raise PatchError(f"could not prepare the apply in {work} ({error}); nothing in the checkout was "
                             f"changed. {hint}, and run again.") from error
        except BaseException:
            remove_work_dir(work)
            raise
        write_changes(root, work, changes)
        remove_work_dir(work)
    return ApplyResult(upstream, version, tuple(states), tuple(recovered))


# ----- check --to ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckoutReport:
    root: Path
    upstream: str
    version: str  # as stated, or why it is unknown
    pinned: tuple[str, ...]
    states: tuple[PatchState, ...]
    interrupted: bool = False  # an apply was killed here and left its journal

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
    with termination_interrupts(), tempfile.TemporaryDirectory(prefix=f"zmrl-check-{upstream}-") as tmp:
        states = stage_series(patches, root, Path(tmp))
    if is_git_work_tree(root):
        states = [_with_three_way_note(state, root) for state in states]
    pinned = tuple(sorted({v for p in patches for v in p.versions}))
    interrupted = journal_path(root / WORK_DIR).is_file()
    return CheckoutReport(root, upstream, _stated_version(upstream, root), pinned, tuple(states), interrupted)
