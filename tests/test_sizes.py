"""Small pieces: no function of the project's code over 80 lines (a newcomer reads one at a time)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FUNCTION_LINES = 80


def long_functions(folders=("app", "engine", "ui", "tools")) -> list[str]:
    """`file:line name (n lines)` for each function longer than MAX_FUNCTION_LINES."""
    found = []
    for folder in folders:
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in (f for f in files if f.endswith(".py")):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), filename=path)
                for n in ast.walk(tree):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = n.end_lineno - n.lineno + 1
                        if lines > MAX_FUNCTION_LINES:
                            found.append(f"{os.path.relpath(path, ROOT)}:{n.lineno} {n.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines():
    assert not long_functions(), "\n".join(long_functions())
