"""The package's tree is its layer table (docs/architecture.md): modules live in their layer's
folder, no module grows past the line limit (split it where its ideas part), and the inner-loop
marker keeps one bitwise test per trainer face."""

from __future__ import annotations

from pathlib import Path

import zero_mismatch_plugin

ROOT = Path(zero_mismatch_plugin.__file__).parent
TESTS = Path(__file__).parent
# A module past this many lines holds more than one idea: split it at its seam.
MAX_MODULE_LINES = 600
FACES = ("aligned_model", "megatron", "fsdp")


def _long_modules(root: Path, limit: int) -> list[str]:
    return sorted(f"{p.relative_to(root)}: {n} lines" for p in root.rglob("*.py")
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit)


def test_no_module_at_the_top_of_the_package_but_its_init():
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py"]


def test_no_package_module_over_the_line_limit(tmp_path):
    assert _long_modules(ROOT, MAX_MODULE_LINES) == []
    planted = tmp_path / "layer" / "big.py"
    planted.parent.mkdir()
    planted.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _long_modules(tmp_path, MAX_MODULE_LINES) == [f"layer/big.py: {MAX_MODULE_LINES + 1} lines"]


def test_the_inner_loop_marker_reaches_every_trainer_face():
    for face in FACES:
        marked = [p.name for p in (TESTS / "faces" / face).glob("test_*.py") if "pytest.mark.quick" in p.read_text()]
        assert marked, f"no test of the {face} face is in `pytest -m quick`"
