"""An edit of an upstream file (replace one exact, unique piece of its text), and how edits apply."""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root of the upstream, e.g. "verl/__init__.py"
    old: str  # must occur exactly once in the file
    new: str


class EditError(RuntimeError):
    pass


def source_of(fn) -> str:
    """The source of the plugin's function ``fn``, dedented, to insert into an upstream file."""
    return textwrap.dedent(inspect.getsource(fn))


def apply_edits(text: str, edits: list[Edit], path: str) -> str:
    for edit in edits:
        count = text.count(edit.old)
        if count != 1:
            raise EditError(f"{path}: the text to replace occurs {count} times, not once:\n{edit.old}")
        text = text.replace(edit.old, edit.new)
    return text
