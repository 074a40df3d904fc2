"""Patches in the form ``git format-patch --full-index --zero-commit --no-signature`` writes.

One-commit mails whose ``index`` lines name the pinned upstream files' blobs, so ``git am -3``
can merge on a drifted fork; ``patch -p1`` and ``git apply`` read them too. See docs/patches.md.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import textwrap
from dataclasses import dataclass

from zero_mismatch_plugin.fork_patches.messages import CommitMessage

ZERO_COMMIT = "0" * 40
AUTHOR = "zero-mismatch-plugin maintainers <maintainers@zero-mismatch-plugin.invalid>"
# A fixed author date keeps the rendered files reproducible (a test compares them byte for byte).
DATE = "Mon, 30 Nov 2026 00:00:00 +0000"
REGULAR_FILE_MODE = "100644"
DIFFSTAT_BAR_WIDTH = 50

_INDEX_LINE = re.compile(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40})(?: (\d{6}))?$")
_DIFF_GIT_LINE = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


class FormatPatchError(ValueError):
    """A change that cannot be written as a patch git and ``patch`` both read the same way."""


def blob_id(data: bytes) -> str:
    """The id git gives a file with these bytes (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class FileChange:
    path: str  # relative to the upstream repository's root
    before: str
    after: str


def file_diff(change: FileChange) -> str:
    """The ``diff --git`` section of one file, with full blob ids in its ``index`` line."""
    for text in (change.before, change.after):
        if text and not text.endswith("\n"):
            raise FormatPatchError(f"{change.path}: a file without a final newline is not supported")
    hunks = "".join(difflib.unified_diff(
        change.before.splitlines(keepends=True), change.after.splitlines(keepends=True),
        fromfile=f"a/{change.path}", tofile=f"b/{change.path}", n=3,
    ))
    old, new = (blob_id(text.encode("utf-8")) for text in (change.before, change.after))
    return f"diff --git a/{change.path} b/{change.path}\nindex {old}..{new} {REGULAR_FILE_MODE}\n{hunks}"


def _counts(section: str) -> tuple[int, int]:
    lines = section.splitlines()
    added = sum(line.startswith("+") and not line.startswith("+++ ") for line in lines)
    removed = sum(line.startswith("-") and not line.startswith("--- ") for line in lines)
    return added, removed


def diffstat(changes: list[FileChange], sections: list[str]) -> str:
    """A diffstat in git's layout (bars scaled to fit when a file changes many lines)."""
    counts = [_counts(section) for section in sections]
    width = max(len(change.path) for change in changes)
    largest = max(a + r for a, r in counts)
    scale = min(1.0, DIFFSTAT_BAR_WIDTH / largest) if largest else 1.0
    digits = len(str(largest))
    rows = []
    for change, (added, removed) in zip(changes, counts):
        plus, minus = round(added * scale), round(removed * scale)
        rows.append(f" {change.path:<{width}} | {added + removed:>{digits}} {'+' * plus}{'-' * minus}")
    total_added, total_removed = sum(a for a, _ in counts), sum(r for _, r in counts)
    summary = f" {len(changes)} file{'s' if len(changes) != 1 else ''} changed"
    if total_added:
        summary += f", {total_added} insertion{'s' if total_added != 1 else ''}(+)"
    if total_removed:
        summary += f", {total_removed} deletion{'s' if total_removed != 1 else ''}(-)"
    return "\n".join(rows + [summary]) + "\n"


def _body(message: CommitMessage) -> str:
    return "\n\n".join(textwrap.fill(p, width=72) for p in message.paragraphs) + "\n"


def format_patch(message: CommitMessage, changes: list[FileChange], number: int, total: int) -> str:
    """One patch of a series, ``number`` of ``total``, as ``git format-patch`` writes it."""
    if not message.subject.isascii() or not all(p.isascii() for p in message.paragraphs):
        raise FormatPatchError(f"{message.subject!r}: commit messages must be plain ASCII")
    sections = [file_diff(change) for change in changes]
    prefix = f"[PATCH {number}/{total}]" if total > 1 else "[PATCH]"
    return (
        f"From {ZERO_COMMIT} Mon Sep 17 00:00:00 2001\n"
        f"From: {AUTHOR}\n"
        f"Date: {DATE}\n"
        f"Subject: {prefix} {message.subject}\n"
        "\n"
        f"{_body(message)}"
        "---\n"
        f"{diffstat(changes, sections)}"
        "\n"
        + "".join(sections)
    )


@dataclass(frozen=True)
class IndexLine:
    path: str
    old: str
    new: str


def index_lines(patch_text: str) -> list[IndexLine]:
    """The blob ids each ``diff --git`` section of a patch names, in order."""
    found, path = [], None
    for line in patch_text.splitlines():
        header = _DIFF_GIT_LINE.match(line)
        if header:
            path = header.group(2)
            continue
        index = _INDEX_LINE.match(line)
        if index and path is not None:
            found.append(IndexLine(path, index.group(1), index.group(2)))
            path = None
    return found
