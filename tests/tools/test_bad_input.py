"""Every bad input in one table: a clear error or a documented finite result, never a
traceback or a silent wrong result. The cases live in ``tests/support/bad_input/cases_*.py`` (one
table per area); the counts per outcome are printed at the end of the run."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

from support import bad_input
from support.bad_input import CLEAR_ERROR, DOCUMENTED_RESULT, SILENT, TRACEBACK, CliResult


def _all_cases():
    cases = []
    for module in pkgutil.iter_modules(bad_input.__path__):
        if module.name.startswith("cases_"):
            area = module.name[len("cases_"):]
            table = importlib.import_module(f"support.bad_input.{module.name}").CASES
            cases += [pytest.param(area, case, id=f"{area}-{case.name}", marks=case.marks) for case in table]
    return cases


CASES = _all_cases()


def _outcome(case) -> tuple[str, str]:
    """Run one case; return (outcome, detail)."""
    try:
        value = case.run()
    except BaseException as raised:  # noqa: BLE001 - classifying every way out is the point
        if isinstance(raised, (KeyboardInterrupt, pytest.fail.Exception, pytest.skip.Exception)):
            raise
        if case.expect == CLEAR_ERROR and case.error is not None and isinstance(raised, case.error):
            if re.search(case.says, str(raised)):
                return CLEAR_ERROR, str(raised)
            return TRACEBACK, f"right type, but the message does not say /{case.says}/: {raised}"
        return TRACEBACK, f"{type(raised).__name__}: {raised}"
    if case.expect == CLEAR_ERROR:
        if isinstance(value, CliResult) and value.code != 0:
            if "Traceback" in value.err:
                return TRACEBACK, value.err[-2000:]
            if re.search(case.says, value.err):
                return CLEAR_ERROR, value.err
            return SILENT, f"exit {value.code} but stderr does not say /{case.says}/: {value.err!r}"
        return SILENT, f"returned {value!r} where an error naming /{case.says}/ was due"
    try:
        case.check(value)
    except AssertionError as wrong:
        return SILENT, f"result is not the documented one ({case.doc}): {wrong}"
    return DOCUMENTED_RESULT, ""


@pytest.mark.parametrize("area,case", CASES)
def test_bad_input(area, case, record_property):
    assert case.expect in (CLEAR_ERROR, DOCUMENTED_RESULT), case
    if case.expect == DOCUMENTED_RESULT:
        assert case.check is not None and case.doc, f"{case.name}: a documented result names its check and its doc"
    else:
        assert case.says, f"{case.name}: a clear error says what to change"
    outcome, detail = _outcome(case)
    record_property("bad_input_outcome", outcome)
    assert outcome == case.expect, f"{case.name}: {outcome}: {detail}"
