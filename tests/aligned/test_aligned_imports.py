"""The op layer's modules import one another without cycles (module- and function-level imports)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import zero_mismatch_plugin.aligned as aligned

ROOT = Path(aligned.__file__).parent
PACKAGE = aligned.__name__


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *parts[:-1]) if parts[-1] == "__init__" else (PACKAGE, *parts))


def _import_graph() -> dict[str, set[str]]:
    """{module: the op-layer modules it imports}, with the packages each import runs first."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(prefix + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                while target.startswith(PACKAGE):  # importing a module runs its packages' __init__ first
                    if target != name and not name.startswith(target + "."):
                        deps.add(target)
                    target = target.rpartition(".")[0]
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_the_op_layer():
    graph = _import_graph()
    assert f"{PACKAGE}.lora.ops" in graph and f"{PACKAGE}.runtime" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_planted_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_the_worker_extension_names_the_weight_sync_class():
    from zero_mismatch_plugin.aligned.runtime import WORKER_EXTENSION
    from zero_mismatch_plugin.aligned.weight_sync import WeightSyncExtension

    module, _, cls = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), cls) is WeightSyncExtension
