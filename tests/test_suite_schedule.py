"""How the suite is spread over its two xdist workers (tests/conftest.py): every module that starts
several compute processes at once (verl's whole trainer, a torchrun rank group) is in the one work
unit that a single worker runs, so that no two such runs share the host's two cores and memory."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What starts them: the launcher of verl's trainer, directly or through the tests' run_verl
# (test_smoke_assets.py calls it through the module only to see it refuse before starting
# anything), torchrun ranks, a Megatron rank group, a support script's forked ranks.
STARTS_PROCESSES = re.compile(r"^from zero_mismatch_plugin\.integrations\.verl\.cpu\.launch import .*\brun_smoke\b"
                              r"|^from support\.main_ppo_runs import [^)]*\brun_verl\b"
                              r"|^from support\.torchrun import|^\s*from zero_mismatch_plugin\.integrations\.megatron"
                              r"\.rank_group import RankGroup\b|^from support\.forked_ranks import", re.M)


def test_every_module_that_starts_processes_is_in_the_multi_process_unit(pytestconfig):
    # tests/conftest.py as pytest loaded it (a plain import of "conftest" can find a nested one)
    suite = pytestconfig.pluginmanager.get_plugin(str(ROOT / "tests" / "conftest.py"))
    work_unit = suite.work_unit
    starting = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py")
                      if STARTS_PROCESSES.search(path.read_text()))
    assert starting == sorted(suite.MULTI_PROCESS_MODULES)
    assert {work_unit(module) for module in suite.MULTI_PROCESS_MODULES} == {suite.MULTI_PROCESS_UNIT}
    assert work_unit("tests/tools/test_smoke_assets.py") == "tests/tools/test_smoke_assets.py"
