"""Readable first, and small: no module of the package over 600 lines, no function over 60 lines
of code (its docstring, comments and blank lines not counted; its signature counted)."""

import ast
import pathlib

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_CODE_LINES = 60


def _docstring_lines(node: ast.AST) -> set[int]:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return set(range(first.lineno, first.end_lineno + 1))
    return set()


def code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of `node` that hold code: not blank, not a comment, not its docstring."""
    skip = _docstring_lines(node)
    text = (lines[i - 1].strip() for i in range(node.lineno, node.end_lineno + 1) if i not in skip)
    return sum(1 for t in text if t and not t.startswith("#"))


def _sizes(folder: str) -> tuple[list[str], list[str]]:
    long_modules, long_functions = [], []
    for path in sorted((ROOT / folder).rglob("*.py")):
        lines = path.read_text().splitlines()
        name = path.relative_to(ROOT)
        if len(lines) > MAX_MODULE_LINES:
            long_modules.append(f"{name} ({len(lines)} lines)")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = code_lines(lines, node)
                if n > MAX_FUNCTION_CODE_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({n} lines)")
    return long_modules, long_functions


def test_the_counter_counts_code_only():
    source = 'def f(a,\n      b):\n    """Doc.\n\n    More."""\n    # why\n\n    return a + b\n'
    node = ast.parse(source).body[0]
    assert code_lines(source.splitlines(), node) == 3


@pytest.mark.parametrize("folder", ["eqx_kfac", "benchmarks"])
def test_no_long_modules_or_functions(folder):
    long_modules, long_functions = _sizes(folder)
    assert not long_modules, f"split these modules (one idea per file): {long_modules}"
    assert not long_functions, f"split these functions: {long_functions}"
