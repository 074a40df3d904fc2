"""An edit of an upstream file (replace one exact, unique piece of its text), and how edits apply."""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root of the upstream, e.g. "verl/__init__.py"
    old: str  # must occur exactly ``count`` times in the file; every occurrence is replaced
    new: str
    count: int = 1


class EditError(RuntimeError):
    pass


def source_of(fn) -> str:
    """The source of the plugin's function ``fn``, dedented, to insert into an upstream file."""
    return textwrap.dedent(inspect.getsource(fn))


def functions_before(path: str, anchor: str, *functions) -> Edit:
    """An edit of ``path`` that inserts the plugin's ``functions`` (their source, two blank lines
    apart) right before the top-level text ``anchor`` (e.g. ``"class Foo:\n"``)."""
    inserted = "".join(source_of(fn) + "\n\n" for fn in functions)
    return Edit(path, old="\n\n" + anchor, new="\n\n" + inserted + anchor)


def apply_edits(text: str, edits: list[Edit], path: str) -> str:
    for edit in edits:
        count = text.count(edit.old)
        if count != edit.count:
            expected = "once" if edit.count == 1 else f"{edit.count} times"
            raise EditError(f"{path}: the text to replace occurs {count} times, not {expected}:\n{edit.old}")
        text = text.replace(edit.old, edit.new)
    return text
