"""The examples' modules, loaded from their files (examples/ is not a package)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.support.processes import REPO


def load_example(relative: str, name: str) -> ModuleType:
    """``examples/<relative>`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / relative)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
