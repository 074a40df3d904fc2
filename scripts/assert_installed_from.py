"""Check that zero_mismatch_plugin, its entry points and `zmrl` come from one install in SITE.

Usage: python assert_installed_from.py SITE CHECKOUT ZMRL, run from outside CHECKOUT by the
interpreter of the environment under test (scripts/check_wheel_install.sh). Exits 1 naming what
came from elsewhere: an import from the checkout, a second install (an editable one seen next to
the wheel), an entry point declared twice or by another install.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path

DISTRIBUTION = "zero-mismatch-plugin"
ENTRY_POINTS = (("verl.plugins", "zero_mismatch"), ("vllm.general_plugins", "zero_mismatch"), ("console_scripts", "zmrl"))


def _site_of(distribution: metadata.Distribution) -> Path:
    return Path(distribution.locate_file("")).resolve()


def problems(site: Path, checkout: Path, zmrl: Path) -> list[str]:
    import zero_mismatch_plugin

    found = []
    package = Path(zero_mismatch_plugin.__file__).resolve()
    if not package.is_relative_to(site) or package.is_relative_to(checkout):
        found.append(f"zero_mismatch_plugin is imported from {package.parent}, not from {site}")
    installs = [d for d in metadata.distributions() if d.metadata["Name"] == DISTRIBUTION]
    if [_site_of(d) for d in installs] != [site]:
        found.append(f"{DISTRIBUTION} is installed at {[str(_site_of(d)) for d in installs]}, expected only {site}")
    for group, name in ENTRY_POINTS:
        declared = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
        sites = [str(_site_of(ep.dist)) for ep in declared]
        if sites != [str(site)]:
            found.append(f"entry point {group}:{name} is declared by installs at {sites}, expected only {site}")
    if not zmrl.is_file() or not zmrl.resolve().is_relative_to(site.parents[2]):
        found.append(f"zmrl at {zmrl} is not the environment's own script")
    return found


def main(argv: list[str]) -> int:
    site, checkout, zmrl = (Path(arg).resolve() for arg in argv)
    found = problems(site, checkout, zmrl)
    for problem in found:
        print(f"wheel check FAILED: {problem}", file=sys.stderr)
    if not found:
        print(f"  package, {DISTRIBUTION} metadata, entry points and zmrl: all from {site}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
