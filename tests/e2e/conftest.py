"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from orders.cli import main
from tests.support.processes import kill_embedded_redis


@pytest.fixture
def home(embedded_binary: None) -> Iterator[Path]:
    """A short home folder (unix socket paths are limited); its server is stopped after."""
    folder = Path(tempfile.mkdtemp(prefix="oh", dir="/tmp"))
    try:
        yield folder
    finally:
        kill_embedded_redis(folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def run(database_url: str, redis_url: str, redis_client: Any) -> Any:
    """Run ``orders ARGS`` in process against the test's stores."""
    env = {"ORDERS_DATABASE_URL": database_url, "ORDERS_REDIS_URL": redis_url}

    def invoke(*args: str) -> Result:
        return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)

    return invoke
