"""bench/ is programs over a few helper modules: no program imports another program, and no file
edits sys.path (a script's own directory is already first on it, which is how the programs find
their helpers)."""

from __future__ import annotations

import ast

from bench_scripts import BENCH

MODULES = {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(BENCH.glob("*.py"))}


def is_program(name: str, tree: ast.Module) -> bool:
    """A program runs as `python bench/<name>.py` (a `__main__` block), or as a pytest-benchmark
    suite (test_*.py)."""
    return name.startswith("test_") or any(
        isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body
    )


def imported(tree: ast.Module) -> set[str]:
    """The top-level names of every absolute import in the module, at any depth."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_bench_file_imports_a_program():
    programs = {name for name, tree in MODULES.items() if is_program(name, tree)}
    assert {"allreduce_bw", "train_step", "convergence", "netsim"} <= programs  # the check sees them
    for name, tree in MODULES.items():
        assert not imported(tree) & programs, f"bench/{name}.py imports {sorted(imported(tree) & programs)}"


def test_no_bench_file_edits_sys_path():
    for name, tree in MODULES.items():
        edits = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ]
        assert not edits, f"bench/{name}.py uses sys.path on line(s) {edits}"
