"""Code shape: no function or method in src/specgate is longer than MAX_FUNCTION_LINES lines (def line to last line,
decorators excepted), so that each can be read at once. Known exceptions wait in PENDING, to be emptied."""

import ast
from pathlib import Path

import pytest

MAX_FUNCTION_LINES = 80
SRC = Path(__file__).resolve().parent.parent / "src" / "specgate"
# (path relative to src/specgate, qualified name) of functions still over the limit, each owned by ongoing work;
# a whole folder is written as (folder + "/", "*"). Remove an entry when its function is split.
PENDING: set[tuple[str, str]] = set()  # (path, name) or (folder, "*") while a split is under way; empty: none over


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length in lines) of every function in `source` longer than `limit` lines."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = child.end_lineno - child.lineno + 1
                    if length > limit:
                        found.append((name, child.lineno, length))
                name += "."
            visit(child, name)

    visit(ast.parse(source), "")
    return found


def pending(path: str, name: str) -> bool:
    return (path, name) in PENDING or any(path.startswith(folder) for folder, star in PENDING if star == "*")


def test_no_function_in_src_is_longer_than_the_limit():
    over = []
    for file in sorted(SRC.rglob("*.py")):
        path = file.relative_to(SRC).as_posix()
        for name, line, length in long_functions(file.read_text()):
            if not pending(path, name):
                over.append(f"src/specgate/{path}:{line} {name}: {length} lines")
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers):\n" + "\n".join(over)


def test_the_pending_list_names_only_functions_still_over_the_limit():
    """An entry whose function was split (or renamed) must leave PENDING, so the list only shrinks."""
    still_long = set()
    for file in sorted(SRC.rglob("*.py")):
        path = file.relative_to(SRC).as_posix()
        still_long |= {(path, name) for name, _, _ in long_functions(file.read_text())}
    stale = [entry for entry in PENDING if entry[1] != "*" and entry not in still_long]
    assert not stale, f"PENDING names functions no longer over {MAX_FUNCTION_LINES} lines: remove {stale}"


@pytest.mark.parametrize("body_lines, flagged", [(78, False), (79, True)])
def test_the_check_flags_an_81_line_function_and_passes_an_80_line_one(body_lines, flagged):
    """Negative control: a synthetic def line + docstring + body_lines statements, nested in a class, is 80 or
    81 lines long; only the 81-line one is reported, with its qualified name and length."""
    body = "".join(f"        x{i} = {i}\n" for i in range(body_lines))
    source = f'class Holder:\n    def method(self):\n        """Doc."""\n{body}\n\ndef short():\n    return 1\n'
    expected = [("Holder.method", 2, 81)] if flagged else []
    assert long_functions(source) == expected
