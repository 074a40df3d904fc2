"""Writing a checkout all or nothing: atomic file replacement, a journal with backups, the undo of a
killed run, and the lock that keeps two runs apart."""

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
import threading
from dataclasses import dataclass
from pathlib import Path

from zero_mismatch_plugin.fork_patches.manifest import PatchError

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


def write_hint(error: OSError, path: Path) -> str:
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


def journal_path(work: Path) -> Path:
    return work / JOURNAL


def write_journal(root: Path, work: Path, changes: list[Change]) -> None:
    """Back up every file about to change, then name them, with their digests, in the journal (fsynced)."""
    for change in changes:
        backup = work / "backup" / change.relative
        backup.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(backup, change.before, 0o600)
    entries = [{"path": c.relative, "target": c.target.relative_to(root).as_posix(), "before": _sha256(c.before),
                "after": _sha256(c.after)} for c in changes]
    _write_atomically(journal_path(work), json.dumps({"format": 1, "files": entries}, indent=1).encode(), 0o600)


def remove_work_dir(work: Path) -> None:
    """Remove the journal first (the backups are useless without it), then the rest of the folder."""
    with contextlib.suppress(FileNotFoundError):
        journal_path(work).unlink()
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
                         f"so the checkout is as it was. {write_hint(error, change.target)}, and run "
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
    journal = journal_path(work)
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
                         f"originals there while it runs. {write_hint(error, work)}; nothing was changed.") from error
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
