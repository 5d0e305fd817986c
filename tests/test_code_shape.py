"""The shape of the code: no import cycles among the modules of src/specgate and the scripts of bench/.

Imports are read with ast from every .py file, late imports inside functions included (a cycle hidden by a late
import is still a cycle), and resolved to the modules of the tree: `import a.b` and `from a import b` name module
a.b when it is a file of the tree, else a (the package's __init__). A module's own parent packages are not edges
(Python has imported them before the module runs). A bench/ script is a top-level module by its
file name (that is how the scripts used to import each other). A cycle is a strongly connected set of more than
one module. Negative controls: a synthetic graph with a cycle, and a synthetic tree whose cycle hides behind a late
import, must both be reported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# cycles known and owned elsewhere, to be cut (none left: any cycle fails the test)
KNOWN_CYCLES: list[list[str]] = []


def module_names(root: Path) -> dict[str, Path]:
    """Every .py file under root by its module name (a/b/__init__.py -> a.b, a/b/c.py -> a.b.c)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names a module's source imports (absolute; relative imports resolved against its package)."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names += [f"{base}.{alias.name}" for alias in node.names] + [base]
    return names


def import_graph(roots: list[Path]) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (the longest known prefix of each imported name)."""
    files = {name: path for root in roots for name, path in module_names(root).items()}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in imported(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            parts = name.split(".")
            known = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in files), None)
            if known is not None and known != module and not module.startswith(known + "."):  # its own packages: imported first anyway
                targets.add(known)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycles():
    graph = import_graph([ROOT / "src", ROOT / "bench"])
    assert "specgate.bench.lockstep" in graph and "bench_lockstep" in graph  # both trees were read
    assert "specgate.bench.lockstep" in graph["bench_lockstep"]  # and a script's import of the package resolved
    assert [cycle for cycle in cycles(graph) if cycle not in KNOWN_CYCLES] == []


def test_the_detector_reports_a_cycle_in_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({**graph, "c": set()}) == []  # the same graph with the back edge cut


def test_the_detector_finds_a_cycle_behind_a_late_import(tmp_path):
    """Two scripts that import each other, one at the top, one inside a function (bench/'s old pattern), and a
    package whose module imports its sibling by a relative import that imports it back."""
    (tmp_path / "table.py").write_text("import sweep\n")
    (tmp_path / "sweep.py").write_text("def main():\n    from table import pooled\n    return pooled\n")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "x.py").write_text("from . import y\n")
    (package / "y.py").write_text("from pkg.x import thing\n")
    (tmp_path / "alone.py").write_text("import os\nimport pkg\n")
    assert cycles(import_graph([tmp_path])) == [["pkg.x", "pkg.y"], ["sweep", "table"]]
