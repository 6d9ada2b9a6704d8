"""The shape of the code, checked: backends/ only move bytes (they never import the algorithm),
the modules of compcomm/ + backends/ import each other without a cycle, and no import hides
inside a function to dodge one (the lazy imports of optional dependencies are the exception)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = {"cupy", "mpi4py"}  # imported only when a backend or codec that needs them is built


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "backends":
        parts = ["compcomm", "backends", *parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("compcomm").rglob("*.py"), *ROOT.joinpath("backends").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _imports(name: str, path: Path, known: set[str]) -> tuple[set[str], list[str]]:
    """The project modules `name` imports, and the imports made inside functions."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {  # `if TYPE_CHECKING:` imports: annotations, not imports at run time
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found, local = set(), []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target in known:
                found.add(target)
        root = targets[0].split(".")[0] if targets else ""
        if root not in OPTIONAL and not isinstance(node, ast.Module):
            for parent in ast.walk(tree):
                if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in ast.walk(parent):
                    local.append(f"{name}: {ast.unparse(node)}")
                    break
    return found, local


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    known = set(modules)
    graph, local = {}, []
    for name, path in modules.items():
        graph[name], inside = _imports(name, path, known)
        local += inside
    return graph, local


def test_backends_never_import_the_algorithm():
    graph, _ = _graph()
    arrows = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a.startswith("compcomm.backends")
        for b in targets
        if not b.startswith("compcomm.backends") and b != "compcomm"
    ]
    assert arrows == []


def test_no_import_cycle():
    graph, _ = _graph()
    graph = {a: {b for b in targets if b != "compcomm"} for a, targets in graph.items()}  # the package root
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_no_function_local_imports_but_optional_dependencies():
    _, local = _graph()
    assert local == []
