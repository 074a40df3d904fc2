"""Running ``patch``, ``git apply`` and ``git am`` on a patch file, and reading what they said.

Every run happens in a directory this package made (a staging copy or a throwaway git
repository), never in the user's checkout: results are read from these runs, and the
checkout is written by :mod:`zero_mismatch_plugin.fork_patches` itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# GNU patch's messages are parsed below: the C locale keeps them in English.
_C_LOCALE = {"LC_ALL": "C", "LANG": "C"}
_HUNK = re.compile(r"^Hunk #(\d+) (succeeded|FAILED) at (\d+)(?: \(offset (-?\d+) lines?\))?")
_FILE = re.compile(r"^(?:checking|patching) file (.+)$")


class ToolMissing(RuntimeError):
    """A program the check needs is not installed."""


@dataclass(frozen=True)
class Hunk:
    path: str
    number: int
    line: int  # where it applied, or (when it failed) where the patch expected it
    offset: int  # lines away from where the patch expected it; 0 for a failed hunk
    failed: bool

    def describe(self) -> str:
        if self.failed:
            return f"{self.path}:{self.line} (hunk {self.number} does not match)"
        return f"{self.path}:{self.line} (hunk {self.number}, offset {self.offset:+d} lines)"


@dataclass(frozen=True)
class PatchRun:
    ok: bool
    hunks: tuple[Hunk, ...]  # only the hunks patch reported: moved or failed ones
    output: str

    @property
    def moved(self) -> tuple[Hunk, ...]:
        return tuple(h for h in self.hunks if not h.failed and h.offset)

    @property
    def failed(self) -> tuple[Hunk, ...]:
        return tuple(h for h in self.hunks if h.failed)


def parse_patch_output(output: str) -> tuple[Hunk, ...]:
    """The hunks GNU ``patch`` reports as moved (``offset``) or ``FAILED``, with their files."""
    hunks, path = [], "?"
    for line in output.splitlines():
        file_line = _FILE.match(line)
        if file_line:
            path = file_line.group(1).strip()
            continue
        hunk = _HUNK.match(line)
        if hunk:
            number, status, at, offset = hunk.groups()
            hunks.append(Hunk(path, int(number), int(at), int(offset or 0), status == "FAILED"))
    return tuple(hunks)


def require_program(name: str) -> str:
    program = shutil.which(name)
    if program is None:
        raise ToolMissing(f"the `{name}` program is needed (e.g. apt-get install {name})")
    return program


def run_patch_program(patch_file: Path, root: Path, *, dry_run: bool = False, reverse: bool = False,
                      every_hunk: bool = False) -> PatchRun:
    """``patch -p1`` with no fuzz under ``root``.

    By default ``--forward`` keeps ``--batch`` from reversing a patch it finds applied, and
    with ``reverse`` it makes a patch that is *not* applied fail, so a clean reverse dry run
    means "applied". ``every_hunk`` (``--force``) turns that detection off so that every hunk
    is tried and reported: for diagnosing a patch that does not apply, with ``dry_run``.
    """
    mode = ["--force"] if every_hunk else ["--forward", "--batch"]
    command = [
        require_program("patch"), "-p1", *mode, "--fuzz=0", "--no-backup-if-mismatch",
        "--reject-file=-", "-d", str(root), "-i", str(patch_file),
    ]
    if reverse:
        command.append("-R")
    if dry_run:
        command.append("--dry-run")
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **_C_LOCALE})
    output = (result.stdout + result.stderr).strip()
    return PatchRun(result.returncode == 0, parse_patch_output(output), output)


# ----- git --------------------------------------------------------------------------------------

_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "zmrl patches check", "GIT_AUTHOR_EMAIL": "check@zero-mismatch-plugin.invalid",
    "GIT_COMMITTER_NAME": "zmrl patches check", "GIT_COMMITTER_EMAIL": "check@zero-mismatch-plugin.invalid",
    "GIT_AUTHOR_DATE": "2026-11-30T00:00:00+00:00", "GIT_COMMITTER_DATE": "2026-11-30T00:00:00+00:00",
}


def _git_environment() -> dict[str, str]:
    # The user's git settings (hooks, signing, am.threeWay, a GIT_DIR of an enclosing
    # repository) must not change what a throwaway repository does.
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return {**environment, **_C_LOCALE, **_GIT_IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([require_program("git"), *args], cwd=cwd, capture_output=True, text=True,
                          env=_git_environment())


def init_repository(root: Path, message: str) -> None:
    """Make ``root`` (holding the files to patch) a git repository with one commit of them."""
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", message]):
        result = git(args, root)
        if result.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} in {root}: {(result.stdout + result.stderr).strip()}")


def git_am(patch_file: Path, repository: Path, *, three_way: bool) -> tuple[bool, str]:
    """``git am [-3]`` one patch; on failure the attempt is aborted so the next can run."""
    result = git(["am", "-q", *(["-3"] if three_way else []), str(patch_file)], repository)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        git(["am", "--abort"], repository)
    return result.returncode == 0, output


def git_apply(patch_file: Path, repository: Path) -> tuple[bool, str]:
    result = git(["apply", str(patch_file)], repository)
    return result.returncode == 0, (result.stdout + result.stderr).strip()


def has_object(repository: Path, object_id: str) -> bool:
    """Whether the git repository that holds ``repository`` knows the object ``object_id``."""
    return git(["cat-file", "-e", object_id], repository).returncode == 0


def is_git_work_tree(directory: Path) -> bool:
    result = git(["rev-parse", "--is-inside-work-tree"], directory)
    return result.returncode == 0 and result.stdout.strip() == "true"
