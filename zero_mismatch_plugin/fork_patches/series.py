"""Applying an upstream's patch series to a checkout: stage every file, then write, all or nothing.

Every patch is first tried, in manifest order, on a staging copy of the files the series
touches; the checkout is written only when none of them fails and every file can be written
inside it. Each file is replaced atomically; a failed write or a signal puts back what was
written, and a killed run's journal (``.zmrl-apply`` in the checkout) lets the next run undo it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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

# While apply writes a checkout it keeps, in this folder of the checkout root, the staged files,
# a backup of every file it changes and a journal naming them; only a killed run leaves it.
WORK_DIR = ".zmrl-apply"
JOURNAL = "journal.json"


class ApplyInterrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP during apply; the message says in what state the checkout was left."""


def temp_path(path: Path) -> Path:
    """The temporary file beside ``path`` that an atomic write goes through (a fixed name, so a rerun finds it)."""
    return path.with_name(f".{path.name}.zmrl-apply.tmp")


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    temp = temp_path(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)  # one a killed run left
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if owner is not None:
                with contextlib.suppress(OSError):
                    os.fchown(fd, *owner)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_directory(path.parent)


def write_file(path: Path, data: bytes) -> None:
    """Replace one file of the checkout atomically (temp file beside it, fsync, rename); mode and owner kept."""
    try:
        status = path.stat()
    except FileNotFoundError:
        _write_atomically(path, data, 0o644)
        return
    _write_atomically(path, data, stat.S_IMODE(status.st_mode), (status.st_uid, status.st_gid))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_hint(error: OSError, path: Path) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"Free space on the file system that holds {path.parent}"
    if error.errno == errno.EROFS:
        return f"The file system that holds {path.parent} is mounted read-only: remount it read-write"
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"Give yourself read and write permission on {path} and {path.parent} (chmod u+rw)"
    return "Fix the cause"


@dataclass(frozen=True)
class Change:
    """One checkout file apply rewrites: ``relative`` as the patches name it, ``target`` the file written."""

    relative: str
    target: Path
    before: bytes
    after: bytes


def staged_changes(root: Path, staging: Path, relatives: list[str]) -> list[Change]:
    """The staged files that differ from the checkout's, with the path each one is written to."""
    changes = []
    for relative in relatives:
        staged, current = (staging / relative).read_bytes(), (root / relative).read_bytes()
        if staged != current:
            changes.append(Change(relative, (root / relative).resolve(), current, staged))
    return changes


def _link_on_the_way(root: Path, relative: str) -> Path | None:
    """The first symbolic link on the path from ``root`` to ``relative``, or None."""
    path = root
    for part in Path(relative).parts:
        path = path / part
        if path.is_symlink():
            return path
    return None


def _outside(root: Path, change: Change) -> str:
    link = _link_on_the_way(root, change.relative)
    if link is None:
        return f"{change.relative} resolves to {change.target}, outside the checkout {root}"
    pointed, named = os.readlink(link), link.relative_to(root).as_posix()
    resolved = link.resolve()
    where = pointed if Path(pointed) == resolved else f"{pointed} ({resolved})"
    prefix = "" if named == change.relative else f"{change.relative}: "
    return (f"{prefix}{named} is a symbolic link to {where}, outside the checkout {root}; apply writes only inside "
            "the checkout: replace the link with a copy of what it points to, or apply to the checkout it points into")


def check_targets(root: Path, changes: list[Change]) -> None:
    """Refuse, before anything is written, a file apply cannot or must not write (outside the checkout, read-only)."""
    problems, seen = [], {}
    for change in changes:
        target = change.target
        if not target.is_relative_to(root):
            problems.append(_outside(root, change))
            continue
        if target in seen:
            problems.append(f"{change.relative} and {seen[target]} are the same file ({target.relative_to(root)}): "
                            "replace the link with a copy of the file")
            continue
        seen[target] = change.relative
        mode = stat.S_IMODE(target.stat().st_mode)
        if not mode & 0o222 or not os.access(target, os.W_OK):
            problems.append(f"{change.relative} is read-only (mode {mode:04o}): make it writable "
                            f"(`chmod u+w {target}`), or apply to a writable copy of the checkout")
        elif not os.access(target.parent, os.W_OK | os.X_OK):
            problems.append(f"{target.parent} is not writable: each file is written through a temporary file "
                            "beside it; make the directory writable (chmod u+w)")
    if problems:
        lines = "\n".join(f"  {problem}" for problem in problems)
        raise PatchError(f"{root}: apply cannot write every file the patches change, so nothing was changed:\n{lines}")


def _journal_path(work: Path) -> Path:
    return work / JOURNAL


def write_journal(root: Path, work: Path, changes: list[Change]) -> None:
    """Back up every file about to change, then name them, with their digests, in the journal (fsynced)."""
    for change in changes:
        backup = work / "backup" / change.relative
        backup.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(backup, change.before, 0o600)
    entries = [{"path": c.relative, "target": c.target.relative_to(root).as_posix(), "before": _sha256(c.before),
                "after": _sha256(c.after)} for c in changes]
    _write_atomically(_journal_path(work), json.dumps({"format": 1, "files": entries}, indent=1).encode(), 0o600)


def remove_work_dir(work: Path) -> None:
    """Remove the journal first (the backups are useless without it), then the rest of the folder."""
    with contextlib.suppress(FileNotFoundError):
        _journal_path(work).unlink()
    _fsync_directory(work)
    shutil.rmtree(work, ignore_errors=True)


def restore(changes: list[Change]) -> list[str]:
    """Put the original bytes back into every file in ``changes`` that differs from them; the ones that could not be."""
    left = []
    for change in changes:
        try:
            with contextlib.suppress(FileNotFoundError):
                temp_path(change.target).unlink()
            if change.target.read_bytes() != change.before:
                write_file(change.target, change.before)
        except OSError as error:
            left.append(f"{change.relative} ({error})")
    return left


def write_changes(root: Path, work: Path, changes: list[Change]) -> None:
    """Write every change atomically; if one write fails or a signal comes, put back what was written."""
    change = None
    try:
        for change in changes:
            write_file(change.target, change.after)
    except (OSError, KeyboardInterrupt) as error:
        if change is None:
            raise
        left = restore(changes)
        stop = isinstance(error, KeyboardInterrupt)
        what = "interrupted while writing" if stop else "could not write"
        cause = "" if stop else f" ({error})"
        if left:
            raise PatchError(f"{what} {change.target}{cause}, and could not restore {', '.join(left)}: restore "
                             f"them from version control, or run `zmrl patches apply --to {root}` again once "
                             f"the cause is fixed: it puts back the originals kept in {work}") from error
        remove_work_dir(work)
        if stop:
            raise ApplyInterrupted(f"interrupted while writing {change.target}; the files written before it "
                                   f"were restored, so {root} is as it was") from error
        raise PatchError(f"could not write {change.target}{cause}; the files written before it were restored, "
                         f"so the checkout is as it was. {_write_hint(error, change.target)}, and run "
                         "again.") from error


def recover_interrupted(root: Path) -> list[str]:
    """Undo what an apply that was killed had written (from its journal and backups); the files put back."""
    work = root / WORK_DIR
    if work.is_symlink():
        raise PatchError(f"{work} is a symbolic link to {os.readlink(work)}; apply keeps its staged files, backups "
                         "and journal in that folder of the checkout and writes only inside the checkout: remove "
                         "the link, then run again")
    if work.exists() and not work.is_dir():
        raise PatchError(f"{work} is a file; apply keeps its journal in a folder of that name: move the file away, "
                         "then run again")
    if not work.exists():
        return []
    journal = _journal_path(work)
    if not journal.is_file():  # killed before it wrote any file of the checkout
        remove_work_dir(work)
        return []
    try:
        entries = json.loads(journal.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PatchError(f"{journal}: an interrupted apply left a journal that cannot be read ({error}); the "
                         f"original files are in {work / 'backup'}: compare, copy back what you need, remove "
                         f"{work} and run again") from error
    for entry in entries:  # the temporary file of the write the kill stopped
        target = (root / entry["target"]).resolve()
        if target.is_relative_to(root):
            with contextlib.suppress(FileNotFoundError):
                temp_path(target).unlink()
    to_put_back, changed = [], []  # all checked before any is written: a refusal changes nothing
    for entry in entries:
        target, backup = (root / entry["target"]).resolve(), work / "backup" / entry["path"]
        current = _sha256(target.read_bytes()) if target.is_file() and target.is_relative_to(root) else None
        if current == entry["before"]:
            continue
        original = backup.read_bytes() if backup.is_file() else b""
        if current != entry["after"] or _sha256(original) != entry["before"]:
            changed.append(entry["path"])
        else:
            to_put_back.append((entry["path"], target, original))
    if changed:
        raise PatchError(f"{root}: an interrupted `zmrl patches apply` left {work}, and {', '.join(changed)} "
                         f"changed after it (neither the original nor the patched file), so nothing was put back. "
                         f"Compare each with its original in {work / 'backup'}, then remove {work} and run again.")
    for _, target, original in to_put_back:
        write_file(target, original)
    put_back = [relative for relative, _, _ in to_put_back]
    remove_work_dir(work)
    return put_back


def make_work_dir(root: Path) -> Path:
    work = root / WORK_DIR
    try:
        work.mkdir()
    except OSError as error:
        raise PatchError(f"cannot create {work} ({error}): apply keeps the staged files and a backup of the "
                         f"originals there while it runs. {_write_hint(error, work)}; nothing was changed.") from error
    return work


@contextlib.contextmanager
def checkout_lock(root: Path):
    """Hold an exclusive lock on the checkout root while apply runs there (released if the process dies)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PatchError(f"another `zmrl patches apply` is running on {root}: wait for it to finish, then run "
                             "again") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def termination_interrupts():
    """SIGTERM and SIGHUP raise KeyboardInterrupt meanwhile, so they clean up as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


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
            hint = _write_hint(error, Path(error.filename or work / "staging"))
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
    interrupted = _journal_path(root / WORK_DIR).is_file()
    return CheckoutReport(root, upstream, _stated_version(upstream, root), pinned, tuple(states), interrupted)
