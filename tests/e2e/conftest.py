"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import kill_embedded_redis


@pytest.fixture
def home(embedded_binary: None) -> Iterator[Path]:
    """A short home folder (unix socket paths are limited); its server is stopped after."""
    folder = Path(tempfile.mkdtemp(prefix="oh", dir="/tmp"))
    try:
        yield folder
    finally:
        kill_embedded_redis(folder)
        shutil.rmtree(folder, ignore_errors=True)
