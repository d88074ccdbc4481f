"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from orders.bootstrap import build_engine
from orders.config import Settings
from tests.support.stores import ENGINES


@pytest.fixture(params=ENGINES)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database without any schema, on each engine."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    target, _ = request.getfixturevalue("postgres_template")
    name = target.new_database()
    try:
        yield target.url(name)
    finally:
        target.drop_database(name)


@pytest.fixture
def empty_engine(empty_url: str) -> Iterator[Engine]:
    engine = build_engine(Settings(database_url=empty_url))
    try:
        yield engine
    finally:
        engine.dispose()
