"""scripts/assert_installed_from.py, the check scripts/check_wheel_install.sh makes after installing
the wheel in a fresh environment (.ci/run runs the whole script): it must fail when the package,
its metadata or its entry points come from anywhere but that environment. Planted faults."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from support import REPO  # noqa: E402
CHECK = REPO / "scripts" / "assert_installed_from.py"
SITE = Path(sysconfig.get_path("purelib")).resolve()
ZMRL = Path(sys.executable).parent / "zmrl"


def _check(tmp_path: Path, site: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    return subprocess.run([sys.executable, str(CHECK), str(site), str(REPO), str(ZMRL)], cwd=tmp_path,
                          capture_output=True, text=True, env=environment, timeout=120)


def test_an_import_from_the_checkout_is_caught(tmp_path):
    # This test environment's own install is editable: the package is the checkout's.
    result = _check(tmp_path, SITE)
    assert result.returncode == 1
    assert f"zero_mismatch_plugin is imported from {REPO / 'zero_mismatch_plugin'}, not from {SITE}" in result.stderr


def test_a_second_install_and_its_entry_points_are_caught(tmp_path):
    other = tmp_path / "other-site"
    dist_info = other / "zero_mismatch_plugin-0.0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: zero-mismatch-plugin\nVersion: 0.0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[verl.plugins]\nzero_mismatch = zero_mismatch_plugin.integrations.verl.register\n")
    result = _check(tmp_path, SITE, PYTHONPATH=str(other))
    assert result.returncode == 1
    assert f"zero-mismatch-plugin is installed at ['{other}', '{SITE}']" in result.stderr or (
        f"zero-mismatch-plugin is installed at ['{SITE}', '{other}']" in result.stderr), result.stderr
    # importlib.metadata keeps the first install of a name on sys.path, as verl's plugin loading does.
    assert f"entry point verl.plugins:zero_mismatch is declared by installs at ['{other}']" in result.stderr
