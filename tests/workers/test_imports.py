"""The data plane's modules import each other without a cycle (lazy and TYPE_CHECKING imports
count too): each module can be read, tested and moved from its imports down."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_imports() -> dict[str, set[str]]:
    """workers.* module -> the workers.* modules it imports (a name imported from a package
    that is itself a module counts as that module)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "workers").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps |= {m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                         if m in paths}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in paths}
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] (depth-first search, three colours)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for dep in sorted(graph[module]):
            if cycle := visit(dep):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return []


def test_workers_have_no_import_cycle():
    graph = module_imports()
    assert "workers.runner" in graph and "workers.spec.step" in graph["workers.runner"]
    assert find_cycle(graph) == []


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
