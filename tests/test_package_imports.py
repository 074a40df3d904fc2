"""The package's modules import one another without cycles and only downwards through the layers
(module- and function-level imports, read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import zero_mismatch_plugin

ROOT = Path(zero_mismatch_plugin.__file__).parent
PACKAGE = zero_mismatch_plugin.__name__
# Layer -> the layers it must never import (docs/architecture.md): tables and algorithms stand alone,
# the op layer sits under the faces, the faces under the integrations, the tools on top.
NEVER_IMPORTS = {
    "tables": ("algorithms", "aligned", "faces", "integrations", "fork_patches", "tools"),
    "algorithms": ("tables", "aligned", "faces", "integrations", "fork_patches", "tools"),
    "aligned": ("faces", "integrations", "fork_patches", "tools"),
    "faces": ("integrations", "fork_patches", "tools"),
    "integrations": ("tools",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *parts[:-1]) if parts[-1] == "__init__" else (PACKAGE, *parts))


def _import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, with the packages each import runs first."""
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


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {dep}" for module, deps in graph.items() for dep in deps
                  if _layer(dep) in NEVER_IMPORTS.get(_layer(module), ()))


def test_no_import_cycle_in_the_package():
    graph = _import_graph()
    assert f"{PACKAGE}.aligned.lora.ops" in graph and f"{PACKAGE}.tools.cli" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_layer_imports_a_layer_above_it():
    graph = _import_graph()
    assert set(NEVER_IMPORTS) | {"fork_patches", "tools"} == {_layer(m) for m in graph} - {None}
    assert _upward_imports(graph) == []


def test_a_planted_cycle_and_a_planted_upward_import_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    planted = {f"{PACKAGE}.aligned.ops": {f"{PACKAGE}.faces.fsdp"}, f"{PACKAGE}.faces.fsdp": set()}
    assert _upward_imports(planted) == [f"{PACKAGE}.aligned.ops -> {PACKAGE}.faces.fsdp"]
