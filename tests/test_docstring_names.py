"""Every dotted `qtool.x.y` a docstring names exists: the longest prefix that imports as a module,
then attributes for the rest; and every file under qtool/, docs/, benchmarks/ or tests/ it names
exists. Modules move; a docstring pointing at the old place sends the reader nowhere, and nothing
else notices."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qtool"

# `qtool.` not inside a path or a longer name (configs/qtool.yaml, my_qtool.x).
NAME = re.compile(r"(?<![\w/.-])qtool(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])(?:qtool|docs|benchmarks|tests)/[\w/-]+\.\w+")  # relative to the repository


def _docstrings(tree: ast.Module):
    """(line, text) of the module's, each class's and each function's docstring."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield first.value.lineno, first.value.value


def named(pattern: re.Pattern = NAME):
    """(file:line, name) for every match of `pattern` in a docstring."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _docstrings(ast.parse(path.read_text(), str(path))):
            for match in pattern.finditer(text):
                where = f"{path.relative_to(ROOT)}:{line + text.count(chr(10), 0, match.start())}"
                yield where, match.group(0)


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and not (module + ".").startswith(exc.name + "."):
                raise  # the module exists; something it imports does not
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_every_name_a_docstring_gives_exists():
    names = list(named())
    stale = [f"{where}: {name}" for where, name in names if not resolves(name)]
    assert not stale, f"{len(stale)} names in docstrings that do not import:\n" + "\n".join(stale)
    assert len(names) > 20  # the test reads real docstrings


def test_every_file_a_docstring_gives_exists():
    paths = list(named(PATH))
    stale = [f"{where}: {path}" for where, path in paths if not (ROOT / path).is_file()]
    assert not stale, f"{len(stale)} file paths in docstrings that do not exist:\n" + "\n".join(stale)
    assert paths  # the test reads real docstrings
