"""The tests' own layout: a test module imports what tests share from ``tests.support``,
never another test module or a conftest (fixtures are requested, not imported)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, as dotted names (``from . import x`` resolved too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["tests", *path.relative_to(TESTS).parent.parts]
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *filter(None, [node.module])])
            found.append(module)
            found += [f"{module}.{alias.name}" for alias in node.names]
    return found


def forbidden(module: str) -> bool:
    """A test module (``test_*``) or a conftest, wherever it lies."""
    last = module.rpartition(".")[2]
    return last == "conftest" or last.startswith("test_")


def test_no_test_module_imports_another_test_module_or_a_conftest() -> None:
    test_files = sorted(TESTS.rglob("test_*.py"))
    assert len(test_files) > 50  # the walk found the suite
    wrong = {
        str(path.relative_to(TESTS)): bad
        for path in test_files
        if (bad := [m for m in imported_modules(path) if forbidden(m)])
    }
    assert wrong == {}
