"""How the suite is spread over its two xdist workers (tests/conftest.py): every module that starts
verl's whole trainer is in the one work unit that a single worker runs, so that no two verl runs
share the host's two cores and memory."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import VERL_RUN_MODULES, VERL_RUN_UNIT, work_unit

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_that_starts_verls_trainer_is_in_the_verl_run_unit():
    # a module that imports the launcher's run_smoke starts verl (test_smoke_assets.py calls it
    # through the module only to see it refuse before starting anything)
    imports_run_smoke = re.compile(r"^from zero_mismatch_plugin\.integrations\.verl\.cpu\.launch import .*\brun_smoke\b", re.M)
    starting = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")
                      if imports_run_smoke.search(path.read_text()))
    assert starting == sorted(VERL_RUN_MODULES)
    assert {work_unit(module) for module in VERL_RUN_MODULES} == {VERL_RUN_UNIT}
    assert work_unit("tests/tools/test_smoke_assets.py") == "tests/tools/test_smoke_assets.py"
