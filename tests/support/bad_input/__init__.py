"""Bad-input cases, one table per area; ``tests/tools/test_bad_input.py`` runs them all.

Every case is one input a user (or a framework calling us) can give, and what must come
of it. There are two acceptable outcomes:

* ``clear_error``: a named exception type whose message matches ``says`` (a regex that
  names what to change), or, for a CLI, a non-zero exit with that text on stderr and no
  traceback;
* ``documented_result``: the call returns, and ``check(result)`` holds: the documented,
  finite result (the docstring or docs page that documents it is named in ``doc``).

Anything else is a failure of the test: an unexpected exception is counted as a
*traceback*, a returned value that fails ``check`` (or a call that returns where an error
was due) as a *silent* wrong result. The counts are printed at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

CLEAR_ERROR = "clear_error"
DOCUMENTED_RESULT = "documented_result"
TRACEBACK = "traceback"
SILENT = "silent"


@dataclass(frozen=True)
class Case:
    """One bad input and what must come of it.

    ``run`` performs the input and returns a value (for a CLI case, a :class:`CliResult`).
    For ``clear_error``: ``error`` is the exception type expected (``None`` for a CLI case,
    which must instead exit non-zero with ``says`` on stderr). For ``documented_result``:
    ``check(value)`` raises ``AssertionError`` when the result is not the documented one.
    """

    name: str
    run: Callable[[], Any]
    expect: str
    says: str = ""
    error: type[BaseException] | tuple[type[BaseException], ...] | None = None
    check: Callable[[Any], None] | None = None
    doc: str = ""
    marks: tuple = field(default_factory=tuple)


@dataclass(frozen=True)
class CliResult:
    """What ``zmrl`` did for one command line: exit code, stdout, stderr."""

    code: int
    out: str
    err: str


def run_cli(argv: list[str]) -> CliResult:
    """Run ``zmrl argv`` in-process, as a user would see it.

    An exception escaping ``main`` is what a user sees as a traceback, so it propagates
    (and is counted as one); ``SystemExit`` (argparse) becomes an exit code.
    """
    import contextlib
    import io

    from zero_mismatch_plugin.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
            if not isinstance(stop.code, (int, type(None))):
                err.write(str(stop.code))
    return CliResult(int(code or 0), out.getvalue(), err.getvalue())


def error(name: str, run: Callable[[], Any], says: str, error: Any = None, **kw: Any) -> Case:
    return Case(name=name, run=run, expect=CLEAR_ERROR, says=says, error=error, **kw)


def result(name: str, run: Callable[[], Any], check: Callable[[Any], None], doc: str, **kw: Any) -> Case:
    return Case(name=name, run=run, expect=DOCUMENTED_RESULT, check=check, doc=doc, **kw)
