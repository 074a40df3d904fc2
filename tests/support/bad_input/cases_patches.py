"""Bad input to `zmrl patches check` and `zmrl patches apply`: directories that are missing, files,
or not a checkout of the upstream named; versions that are wrong, unreadable or contradicted by
--assume-version; checkouts where the patches are already in, partly in, or where the code the
patches expect is missing or has changed (or has CRLF line endings); files that are links out of
the checkout or read-only; a write that fails midway or a full disk; a second apply running, and
the rerun after a killed one.

Every case runs the command line in-process (``run_cli``) on a fake checkout built in a scratch
directory from the installed (pinned) upstream files.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

from support.bad_input import error, result, run_cli

from zero_mismatch_plugin import fork_patches
from zero_mismatch_plugin.fork_patches import checkout_writes

DOC = "docs/patches.md, 'Applying the set to a fork'"
WORK_DIR = ".zmrl-apply"  # where apply keeps its journal while it runs (docs/patches.md)
DRIFT_DOC = "docs/patches.md, 'Another version or a drifted fork: check --to'"
_scratch: list[str] = []


def scratch() -> Path:
    if not _scratch:
        _scratch.append(tempfile.mkdtemp(prefix="zmrl-bad-patches-"))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return Path(tempfile.mkdtemp(dir=_scratch[0]))


def _copy_installed(upstream: str, root: Path, extra: tuple[str, ...] = ()) -> Path:
    manifest = fork_patches.load_manifest()
    installed = fork_patches.installed_root(manifest.upstreams[upstream])
    for relative in [*fork_patches.touched_files(manifest.for_upstream(upstream)), *extra]:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / relative, root / relative)
    return root


def verl_checkout(version: str | bytes = "0.9.1") -> Path:
    root = _copy_installed("verl", scratch())
    (root / "verl/version").mkdir(parents=True, exist_ok=True)
    version_file = root / "verl/version/version"
    if isinstance(version, bytes):
        version_file.write_bytes(version)
    else:
        version_file.write_text(version + "\n")
    return root


def megatron_checkout(package_info=lambda text: text) -> Path:
    root = _copy_installed("megatron-lm", scratch(), extra=("megatron/core/package_info.py",))
    info = root / "megatron/core/package_info.py"
    info.write_text(package_info(info.read_text()))
    return root


def vllm_clone(version_file: str | None = None) -> Path:
    """A vLLM checkout as cloned (no build-generated _version.py), or with the text given."""
    root = _copy_installed("vllm", scratch(), extra=("vllm/envs.py",))
    if version_file is not None:
        (root / "vllm/_version.py").write_text(version_file)
    return root


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def unchanged(run, make):
    """Run ``run(checkout)`` on a fresh ``make()``; return (CliResult, whether the checkout is as before)."""
    def go():
        checkout = make()
        before = _digest(checkout)
        outcome = run(checkout)
        return outcome, _digest(checkout) == before
    return go


def apply(*args: str):
    return lambda checkout: run_cli(["patches", "apply", "--to", str(checkout), *args])


def refused_unchanged(name: str, make, says: str, *args: str):
    """A clear error from `apply`, and the checkout left byte for byte as it was."""
    def go():
        outcome, same = unchanged(apply(*args), make)()
        assert same, "the checkout changed although apply was refused"
        return outcome
    return error(name, go, says)


def _patch_by_hand(checkout: Path, name: str) -> Path:
    diff = fork_patches.load_manifest().by_name(name).diff_path
    subprocess.run(["patch", "-p1", "-s", "-d", str(checkout), "-i", str(diff)], check=True)
    return checkout


def verl_applied() -> Path:
    checkout = verl_checkout()
    for patch in fork_patches.load_manifest().for_upstream("verl"):
        _patch_by_hand(checkout, patch.name)
    return checkout


def verl_half_applied() -> Path:
    """Only the first hunk of verl-reject-unknown-names done by hand."""
    from zero_mismatch_plugin.fork_patches import generate

    checkout = verl_checkout()
    config = checkout / "verl/utils/config.py"
    [change] = generate.render_changes(generate.EDITS["verl-reject-unknown-names"][1:], lambda p: config.read_text())
    config.write_text(change.after)
    return checkout


def verl_drifted(version: str = "0.9.1") -> Path:
    checkout = verl_checkout(version)
    config = checkout / "verl/utils/config.py"
    config.write_text(config.read_text().replace("    # number of GPUs total\n", "    # GPUs in all nodes\n"))
    return checkout


def without(make, relative: str, as_directory: bool = False):
    def build():
        checkout = make()
        (checkout / relative).unlink()
        if as_directory:
            (checkout / relative).mkdir()
        return checkout
    return build


def write_fails_midway():
    calls = []

    def writer(path: Path, data: bytes) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(30, "Read-only file system")
        path.write_bytes(data)

    with mock.patch.object(checkout_writes, "write_file", writer):
        outcome, same = unchanged(apply(), verl_checkout)()
    assert same, "a failed write left the checkout partly patched"
    return outcome


def _check_applied_again(value) -> None:
    outcome, same = value
    assert outcome.code == 0 and same, outcome
    assert "every verl patch is already applied" in outcome.out and "Reversed" not in outcome.out + outcome.err


def _check_rest_applied(value) -> None:
    outcome, _ = value
    assert outcome.code == 0, outcome
    assert "already applied verl-plugin-load-warning" in outcome.out
    assert "applied verl-megatron-engine-hooks: " in outcome.out


def _check_assumed_and_warned(value) -> None:
    outcome, same = value
    assert outcome.code == 0 and not same, outcome
    assert "WARNING:" in outcome.err and "assuming 0.31.0 because --assume-version says so" in outcome.err


def _check_drift_report(value) -> None:
    outcome, same = value
    assert outcome.code == 1 and same, outcome
    assert "verl 0.9.0; the patches were made for 0.9.1" in outcome.out
    assert re.search(r"verl-reject-unknown-names +fails: verl/utils/config.py:112 \(hunk 2 does not match\)",
                     outcome.out), outcome.out
    count = _verl_patch_count()
    assert f"{count - 1} of {count} patches apply or are already applied" in outcome.out


def _check_all_apply_report(value) -> None:
    outcome, same = value
    assert outcome.code == 0 and same, outcome
    count = _verl_patch_count()
    assert f"{count} of {count} patches apply or are already applied" in outcome.out


def _verl_patch_count() -> int:
    from zero_mismatch_plugin.fork_patches import load_manifest

    return len(load_manifest().for_upstream("verl"))


def check_to(*args: str):
    return lambda checkout: run_cli(["patches", "check", "--to", str(checkout), *args])


def _missing_dir():
    return scratch() / "no-such-checkout"


def _a_file():
    path = scratch() / "verl.tar.gz"
    path.write_bytes(b"not a directory")
    return path


def _two_upstreams():
    root = verl_checkout()
    _copy_installed("megatron-lm", root, extra=("megatron/core/package_info.py",))
    return root


def _other_project():
    root = scratch()
    (root / "python/sglang").mkdir(parents=True)
    (root / "python/sglang/version.py").write_text('__version__ = "0.5.0"\n')
    return root


def _leftovers(checkout: Path) -> list[str]:
    """What apply must never leave behind: its work folder, temporary files beside the checkout's files."""
    return [str(p) for p in checkout.rglob("*") if p.name == WORK_DIR or p.name.endswith(".zmrl-apply.tmp")]


def _crlf(relative: str):
    def build():
        checkout = verl_checkout()
        path = checkout / relative
        path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
        return checkout
    return build


def _linked_out(relative: str):
    """A checkout whose ``relative`` (a file or a folder) is a symbolic link to a copy outside it."""
    def build():
        checkout = verl_checkout()
        inside, outside = checkout / relative, scratch() / Path(relative).name
        (shutil.copytree if inside.is_dir() else shutil.copyfile)(inside, outside)
        (shutil.rmtree if inside.is_dir() else Path.unlink)(inside)
        inside.symlink_to(outside)
        return checkout
    return build


def linked_out_refused(name: str, relative: str, says: str):
    """A link out of the checkout: refused, and neither the checkout nor what the link points to changes."""
    def go():
        checkout = _linked_out(relative)()
        outside = (checkout / relative).resolve()
        before = _digest(outside) if outside.is_dir() else outside.read_bytes()
        outcome, same = unchanged(apply(), lambda: checkout)()
        assert same, "the checkout changed although apply was refused"
        assert (_digest(outside) if outside.is_dir() else outside.read_bytes()) == before, \
            f"apply wrote {outside}, outside the checkout"
        return outcome
    return error(name, go, says)


def _read_only(relative: str):
    def build():
        checkout = verl_checkout()
        (checkout / relative).chmod(0o444)
        return checkout
    return build


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def disk_full(nth: int, in_work_dir: bool):
    """Apply with ``os.write`` writing half its bytes, then raising ENOSPC, at the ``nth`` write of a file in
    the checkout (``in_work_dir``: of apply's own backups and journal, else of the checkout's files)."""
    real_write = os.write

    def go():
        checkout = verl_checkout()
        before, calls = _digest(checkout), []

        def write(fd, data):
            path = _fd_path(fd)
            if path.startswith(f"{checkout}/") and (f"/{WORK_DIR}/" in path) == in_work_dir:
                calls.append(path)
                if len(calls) == nth:
                    real_write(fd, bytes(data)[: len(data) // 2])
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        with mock.patch("os.write", write):
            outcome = apply()(checkout)
        assert len(calls) >= nth, f"apply made {len(calls)} writes there, not through a temporary file"
        assert _digest(checkout) == before, "a full disk left the checkout changed"
        assert not _leftovers(checkout), _leftovers(checkout)
        return outcome
    return go


def _while_another_apply_runs():
    checkout = verl_checkout()
    before = _digest(checkout)
    held = os.open(checkout, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running apply holds it
        outcome = apply()(checkout)
    finally:
        os.close(held)
    assert _digest(checkout) == before, "a second apply wrote the checkout while the first held it"
    return outcome


class _Killed(BaseException):
    """Stands for SIGKILL: nothing of apply runs after it (no except, no finally that restores)."""


def _rerun_after_a_killed_apply():
    """Apply killed between two files of one patch (verl-cpu-training), then run again."""
    checkout, calls = verl_checkout(), []
    write = checkout_writes.write_file

    def writer(path: Path, data: bytes) -> None:
        calls.append(path)
        if len(calls) == 6:
            raise _Killed
        write(path, data)

    with mock.patch.object(checkout_writes, "write_file", writer):
        try:
            fork_patches.apply_to(checkout)
        except _Killed:
            pass
    return run_cli(["patches", "apply", "--to", str(checkout)]), checkout


def _check_finished_after_the_kill(value) -> None:
    outcome, checkout = value
    assert outcome.code == 0, outcome
    assert "an earlier apply was interrupted after writing them" in outcome.out, outcome.out
    assert all(f"applied {p.name}: " in outcome.out for p in fork_patches.load_manifest().for_upstream("verl"))
    assert _digest(checkout) == _digest(verl_applied()), "the rerun did not leave the fully patched checkout"
    assert not _leftovers(checkout), _leftovers(checkout)


def _foreign_work_dir():
    checkout = verl_checkout()
    (checkout / WORK_DIR).symlink_to(scratch())
    return checkout


def _check_crlf_report(value) -> None:
    outcome, same = value
    assert outcome.code == 1 and same, outcome
    assert re.search(r"verl-reject-unknown-names +fails: verl/utils/config.py has CRLF line endings \(\d+ of \d+ "
                     r"lines\); the patch expects LF \(convert to LF from the checkout root: `dos2unix "
                     r"verl/utils/config.py`", outcome.out), outcome.out
    assert "the code there differs" not in outcome.out


CASES = [
    # ----- the directory ---------------------------------------------------------------------
    error("apply-missing-directory", lambda: run_cli(["patches", "apply", "--to", str(_missing_dir())]),
          r"no such directory; pass the root of a verl, vLLM, Megatron-LM or mbridge checkout"),
    error("apply-file-instead-of-directory", lambda: run_cli(["patches", "apply", "--to", str(_a_file())]),
          r"is a file, not a directory"),
    error("apply-empty-directory", lambda: run_cli(["patches", "apply", "--to", str(scratch())]),
          r"cannot tell which upstream this checkout is \(found none\)"),
    error("apply-checkout-of-another-project", lambda: run_cli(["patches", "apply", "--to", str(_other_project())]),
          r"cannot tell which upstream this checkout is \(found none\); pass the repository root, or --upstream"),
    error("apply-directory-holding-two-upstreams", lambda: run_cli(["patches", "apply", "--to", str(_two_upstreams())]),
          r"cannot tell which upstream this checkout is \(found verl, megatron-lm\)"),
    error("apply-without-to", lambda: run_cli(["patches", "apply"]), r"the following arguments are required: --to"),
    error("patches-without-subcommand", lambda: run_cli(["patches"]), r"the following arguments are required: \{list,check,apply\}"),
    # ----- the upstream named ----------------------------------------------------------------
    error("apply-unknown-upstream-name", lambda: run_cli(["patches", "apply", "--to", str(verl_checkout()),
                                                          "--upstream", "sglang"]),
          r"argument --upstream: invalid choice: 'sglang'"),
    refused_unchanged("apply-upstream-that-is-not-the-checkout", verl_checkout,
                      r"is not a megatron-lm checkout: it has no megatron/core/package_info.py; "
                      r"it looks like a verl checkout", "--upstream", "megatron-lm"),
    error("check-to-upstream-that-is-not-the-checkout",
          lambda: run_cli(["patches", "check", "--to", str(megatron_checkout()), "--upstream", "vllm"]),
          r"is not a vllm checkout: it has no vllm/envs.py; it looks like a megatron-lm checkout"),
    # ----- versions --------------------------------------------------------------------------
    refused_unchanged("apply-older-verl", lambda: verl_checkout("0.9.0"),
                      r"is verl 0.9.0; the patches were made for 0.9.1 .*Nothing was changed. "
                      r"`zmrl patches check --to .*` shows what would apply"),
    refused_unchanged("apply-newer-verl-dev", lambda: verl_checkout("0.10.0.dev"),
                      r"is verl 0.10.0.dev; the patches were made for 0.9.1"),
    refused_unchanged("apply-verl-version-that-is-no-version", lambda: verl_checkout("banana"),
                      r"is verl banana; the patches were made for 0.9.1"),
    refused_unchanged("apply-verl-empty-version-file", lambda: verl_checkout(""),
                      r"cannot read the verl version of this checkout .*pass --assume-version V if you know it"),
    refused_unchanged("apply-verl-version-file-not-text", lambda: verl_checkout(b"\xff\xfe0.9.1"),
                      r"verl/version/version: not text"),
    refused_unchanged("apply-megatron-core-v0.16.0-with-assume-version-0.16.1",
                      lambda: megatron_checkout(lambda t: re.sub(r"PATCH = \d+", "PATCH = 0", t)),
                      r"states megatron-lm 0.16.0 \(megatron/core/package_info.py\); --assume-version 0.16.1 "
                      r"cannot override a version the checkout states", "--assume-version", "0.16.1"),
    refused_unchanged("apply-megatron-release-candidate", 
                      lambda: megatron_checkout(lambda t: re.sub(r"PRE_RELEASE = .*", "PRE_RELEASE = 'rc0'", t)),
                      r"is megatron-lm 0.16.1rc0; the patches were made for 0.16.1"),
    refused_unchanged("apply-megatron-package-info-broken",
                      lambda: megatron_checkout(lambda t: t + "\nMAJOR = (\n"),
                      r"package_info.py: cannot read the version from it \(SyntaxError"),
    refused_unchanged("apply-megatron-version-computed",
                      lambda: megatron_checkout(lambda t: re.sub(r"PATCH = \d+", "PATCH = int('1')", t)),
                      r"the version is not a literal \(int\('1'\)\)"),
    refused_unchanged("apply-vllm-clone-without-version", vllm_clone,
                      r"cannot read the vllm version .*vllm/_version.py.*pass --assume-version V"),
    refused_unchanged("apply-vllm-clone-assumed-other-version", vllm_clone,
                      r"is vllm 0.30.0; the patches were made for 0.31.0", "--assume-version", "0.30.0"),
    refused_unchanged("apply-vllm-empty-assume-version", vllm_clone, r"--assume-version is empty",
                      "--assume-version", " "),
    refused_unchanged("apply-vllm-version-file-broken", lambda: vllm_clone("__version__ = \n"),
                      r"_version.py: cannot read the version from it \(SyntaxError"),
    refused_unchanged("apply-vllm-built-version-contradicted", lambda: vllm_clone("__version__ = '0.31.1'\n"),
                      r"states vllm 0.31.1 .*cannot override", "--assume-version", "0.31.0"),
    result("apply-vllm-clone-with-assumed-pinned-version",
           unchanged(apply("--assume-version", "0.31.0"), vllm_clone), _check_assumed_and_warned, DOC),
    # ----- the code the patches expect -----------------------------------------------------------
    result("apply-twice", unchanged(apply(), verl_applied), _check_applied_again, DOC),
    result("apply-after-one-patch-by-hand",
           unchanged(apply(), lambda: _patch_by_hand(verl_checkout(), "verl-plugin-load-warning")),
           _check_rest_applied, DOC),
    refused_unchanged("apply-patch-half-applied-by-hand", verl_half_applied,
                      r"verl-reject-unknown-names: fails: verl/utils/config.py:85 \(hunk 1 is already there\) "
                      r"\(the rest of the patch is not: revert the part that is there"),
    refused_unchanged("apply-fork-whose-code-drifted", verl_drifted,
                      r"not every verl patch applies, so nothing was changed:\n  verl-reject-unknown-names: fails: "
                      r"verl/utils/config.py:112 \(hunk 2 does not match\)"),
    refused_unchanged("apply-checkout-missing-a-patched-file", without(verl_checkout, "verl/utils/config.py"),
                      r"verl-reject-unknown-names: fails: verl/utils/config.py: no such file in the checkout"),
    refused_unchanged("apply-patched-path-is-a-directory",
                      without(verl_checkout, "verl/workers/utils/losses.py", as_directory=True),
                      r"verl/workers/utils/losses.py is a directory in the checkout, where the patch changes a "
                      r"file: move the directory away and restore the file"),
    refused_unchanged("apply-file-with-crlf-line-endings", _crlf("verl/utils/config.py"),
                      r"verl-reject-unknown-names: fails: verl/utils/config.py has CRLF line endings \(\d+ of \d+ "
                      r"lines\); the patch expects LF \(convert to LF from the checkout root: `dos2unix "
                      r"verl/utils/config.py`.*`git config core.autocrlf input`"),
    # ----- where apply writes ----------------------------------------------------------------
    linked_out_refused("apply-patched-file-is-a-link-out-of-the-checkout", "verl/utils/config.py",
                       r"verl/utils/config.py is a symbolic link to .*/config.py, outside the checkout .*; apply "
                       r"writes only inside the checkout: replace the link with a copy of what it points to"),
    linked_out_refused("apply-folder-of-patched-files-is-a-link-out-of-the-checkout", "verl/utils",
                       r"verl/utils/config.py: verl/utils is a symbolic link to .*/utils, outside the checkout"),
    refused_unchanged("apply-patched-file-is-read-only", _read_only("verl/utils/config.py"),
                      r"cannot write every file the patches change, so nothing was changed:\n  verl/utils/config.py "
                      r"is read-only \(mode 0444\): make it writable \(`chmod u\+w .*/verl/utils/config.py`\)"),
    refused_unchanged("apply-work-folder-is-a-link-out-of-the-checkout", _foreign_work_dir,
                      r"\.zmrl-apply is a symbolic link to .*; apply keeps its staged files, backups and journal in "
                      r"that folder of the checkout .*: remove the link, then run again"),
    error("apply-write-fails-midway", write_fails_midway,
          r"could not write .*\(\[Errno 30\] Read-only file system\); the files written before it were restored"),
    error("apply-disk-full-in-the-middle-of-a-file", disk_full(3, in_work_dir=False),
          r"could not write .*/verl/workers/utils/losses.py \(\[Errno 28\] No space left on device\); the files "
          r"written before it were restored, so the checkout is as it was. Free space on the file system that holds "
          r".*, and run again"),
    error("apply-disk-full-while-backing-up-the-originals", disk_full(2, in_work_dir=True),
          r"could not prepare the apply in .*/\.zmrl-apply \(\[Errno 28\] No space left on device\); nothing in "
          r"the checkout was changed. Free space on the file system"),
    error("apply-while-another-apply-runs", _while_another_apply_runs,
          r"another `zmrl patches apply` is running on .*: wait for it to finish, then run again"),
    result("apply-again-after-a-killed-apply", _rerun_after_a_killed_apply, _check_finished_after_the_kill, DOC),
    # ----- check --to --------------------------------------------------------------------------
    error("check-to-missing-directory", lambda: run_cli(["patches", "check", "--to", str(_missing_dir())]),
          r"no such directory"),
    error("check-to-file", lambda: run_cli(["patches", "check", "--to", str(_a_file())]), r"is a file, not a directory"),
    error("check-to-empty-directory", lambda: run_cli(["patches", "check", "--to", str(scratch())]),
          r"cannot tell which upstream"),
    error("check-upstream-without-to", lambda: run_cli(["patches", "check", "--upstream", "verl"]),
          r"--upstream goes with --to DIR"),
    result("check-to-another-version-that-drifted", unchanged(check_to(), lambda: verl_drifted("0.9.0")),
           _check_drift_report, DRIFT_DOC),
    result("check-to-a-checkout-already-patched", unchanged(check_to(), verl_applied), _check_all_apply_report,
           DRIFT_DOC),
    result("check-to-a-file-with-crlf-line-endings", unchanged(check_to(), _crlf("verl/utils/config.py")),
           _check_crlf_report, DRIFT_DOC),
]
