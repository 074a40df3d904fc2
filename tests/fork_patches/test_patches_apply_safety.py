"""`zmrl patches apply` interrupted: killed, Ctrl-C'd or terminated in the middle of writing a checkout.

A real ``zmrl patches apply`` runs in a subprocess and is stopped just before it writes the bytes
of one checkout file (its Nth file opened for writing: the temporary file beside it, or the file
itself if it were written in place). After the signal no file of the checkout may be partial or
empty, nothing may be left in the temporary directory, and a rerun must finish the apply (or
refuse, naming the file, when the user changed it since).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest

from zero_mismatch_plugin import fork_patches
from zero_mismatch_plugin.fork_patches import checkout_writes

from support import REPO  # noqa: E402
WORK_DIR = ".zmrl-apply"  # where apply keeps its journal while it runs (docs/patches.md)

# Runs `zmrl patches apply --to CHECKOUT` and stops it right before the data of the PAUSE_AT-th
# checkout file opened for writing is written: prints PAUSED, then sleeps until a signal comes.
# Ctrl-C reaches it as it reaches a terminal's foreground command: a shell that starts the suite in
# the background hands SIGINT down ignored, and Python then installs no KeyboardInterrupt for it.
DRIVER = textwrap.dedent('''
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    checkout, pause_at = sys.argv[1], int(sys.argv[2])
    opened = []

    def audit(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path, mode, flags = os.fsdecode(args[0]), args[1], args[2] or 0
            writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                       else bool(flags & (os.O_WRONLY | os.O_RDWR)))
            inside = path.startswith(checkout + "/") and "/.zmrl-apply/" not in path
            if writing and inside and (not opened or opened[-1] != path):
                opened.append(path)

    paused = []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "write" and len(opened) == pause_at and not paused:
            paused.append(opened[-1])  # at most once, whatever the driver writes afterwards
            print("PAUSED", opened[-1], flush=True)
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:  # short sleeps: the handler runs between two of them
                time.sleep(0.05)

    sys.addaudithook(audit)
    sys.setprofile(profile)
    from zero_mismatch_plugin.tools.cli import main
    sys.exit(main(["patches", "apply", "--to", checkout]))
''')


def _verl_checkout(root: Path) -> Path:
    manifest = fork_patches.load_manifest()
    installed = fork_patches.installed_root(manifest.upstreams["verl"])
    for relative in fork_patches.touched_files(manifest.for_upstream("verl")):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / relative, root / relative)
    (root / "verl/version").mkdir(parents=True)
    (root / "verl/version/version").write_text("0.9.1\n")
    return root


def _patched(root: Path) -> Path:
    checkout = _verl_checkout(root)
    for patch in fork_patches.load_manifest().for_upstream("verl"):
        subprocess.run(["patch", "-p1", "-s", "-d", str(checkout), "-i", str(patch.diff_path)], check=True)
    return checkout


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(checkout: Path) -> list[str]:
    return [str(p) for p in checkout.rglob("*") if p.name == WORK_DIR or p.name.endswith(".zmrl-apply.tmp")]


@pytest.fixture
def setting(tmp_path):
    """A pristine checkout, its fully patched twin, and a private TMPDIR for the subprocesses."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {**os.environ, "TMPDIR": str(temporary),
                   "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return _verl_checkout(tmp_path / "verl"), _patched(tmp_path / "verl-patched"), temporary, environment


def _stopped(checkout: Path, environment: dict, pause_at: int, sig: signal.Signals) -> subprocess.CompletedProcess:
    """Run the driver until it pauses before writing its ``pause_at``-th checkout file, then send ``sig``."""
    process = subprocess.Popen([sys.executable, "-c", DRIVER, str(checkout), str(pause_at)], env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("PAUSED"), line + process.stderr.read()
        process.send_signal(sig)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, line + out, err)


def _apply(checkout: Path, environment: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_mismatch_plugin.tools.cli", "patches", "apply", "--to", str(checkout)],
                          env=environment, capture_output=True, text=True, timeout=300)


def _every_file_whole(checkout: Path, original: dict[str, str], patched: dict[str, str]) -> None:
    for relative, digest in _tree(checkout).items():
        if relative.startswith(WORK_DIR + "/") or relative.endswith(".zmrl-apply.tmp"):
            continue
        assert digest in (original.get(relative), patched.get(relative)), \
            f"{relative} is neither the original nor the patched file ({(checkout / relative).stat().st_size} bytes)"


def test_a_killed_apply_leaves_no_partial_file_and_the_rerun_finishes_it(setting):
    checkout, patched, temporary, environment = setting
    original = _tree(checkout)
    # The 6th file is the second of verl-cpu-training's three: the kill splits one patch.
    stopped = _stopped(checkout, environment, 6, signal.SIGKILL)
    assert stopped.returncode == -signal.SIGKILL, stopped
    _every_file_whole(checkout, original, _tree(patched))
    assert list(temporary.iterdir()) == [], "a killed apply left a temporary folder outside the checkout"
    rerun = _apply(checkout, environment)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "an earlier apply was interrupted after writing them" in rerun.stdout
    assert _tree(checkout) == _tree(patched)
    assert not _leftovers(checkout) and list(temporary.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_apply_restores_the_checkout_and_leaves_nothing_behind(setting, sig):
    checkout, _, temporary, environment = setting
    original = _tree(checkout)
    stopped = _stopped(checkout, environment, 3, sig)
    assert stopped.returncode == 130, stopped
    assert "Traceback" not in stopped.stderr
    assert "the files written before it were restored, so" in stopped.stderr and "is as it was" in stopped.stderr
    assert _tree(checkout) == original
    assert not _leftovers(checkout) and list(temporary.iterdir()) == []


def test_a_rerun_after_a_kill_leaves_a_file_the_user_changed_since_and_says_so(setting):
    checkout, _, _, environment = setting
    stopped = _stopped(checkout, environment, 3, signal.SIGKILL)
    assert stopped.returncode == -signal.SIGKILL, stopped
    edited = checkout / "verl/utils/config.py"  # the second file, written before the kill
    edited.write_text(edited.read_text() + "# edited after the kill\n")
    before = _tree(checkout)
    rerun = _apply(checkout, environment)
    assert rerun.returncode == 1 and "Traceback" not in rerun.stderr
    assert ("verl/utils/config.py changed after it (neither the original nor the patched file), so nothing was "
            "put back") in rerun.stderr
    assert f"Compare each with its original in {checkout / WORK_DIR / 'backup'}" in rerun.stderr
    assert _tree(checkout) == {k: v for k, v in before.items() if not k.endswith(".zmrl-apply.tmp")}
    assert (checkout / WORK_DIR / "backup/verl/utils/config.py").is_file()


class _Killed(BaseException):
    """Stands for SIGKILL at the first write of a checkout file."""


def test_every_original_is_backed_up_and_journalled_before_the_first_file_is_written(setting, monkeypatch):
    checkout, _, _, _ = setting
    original = {relative: (checkout / relative).read_bytes() for relative in _tree(checkout)}

    def first_write(path, data):
        raise _Killed

    monkeypatch.setattr(checkout_writes, "write_file", first_write)
    with pytest.raises(_Killed):
        fork_patches.apply_to(checkout)
    work = checkout / WORK_DIR
    journal = json.loads((work / "journal.json").read_text())
    changed = fork_patches.touched_files(fork_patches.load_manifest().for_upstream("verl"))
    assert [entry["path"] for entry in journal["files"]] == changed
    for entry in journal["files"]:
        backup = (work / "backup" / entry["path"]).read_bytes()
        assert backup == original[entry["path"]]
        assert entry["before"] == hashlib.sha256(backup).hexdigest()
    assert {relative: (checkout / relative).read_bytes() for relative in original} == original
    monkeypatch.undo()
    applied = fork_patches.apply_to(checkout).applied
    assert [p.name for p in applied] == [p.name for p in fork_patches.load_manifest().for_upstream("verl")]
    assert not _leftovers(checkout)


def test_a_written_file_keeps_its_mode_and_a_link_inside_the_checkout_stays_a_link(setting):
    checkout, patched, _, _ = setting
    (checkout / "verl/__init__.py").chmod(0o750)
    config = checkout / "verl/utils/config.py"
    config.rename(checkout / "verl/utils/config_real.py")
    config.symlink_to("config_real.py")
    with mock.patch.object(os, "replace", wraps=os.replace) as replace:
        fork_patches.apply_to(checkout)
    assert replace.called, "the files were written in place, not through a temporary file"
    assert (checkout / "verl/__init__.py").stat().st_mode & 0o7777 == 0o750
    assert config.is_symlink() and config.read_bytes() == (patched / "verl/utils/config.py").read_bytes()
    assert not _leftovers(checkout)
