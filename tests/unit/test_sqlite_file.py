"""Which SQLite URLs name a file the engine watches (``orders.sql.engine.sqlite_file``):
a memory database has none, so it is exempt from the deleted-or-replaced check."""

from __future__ import annotations

import os

import pytest

from orders.config import Settings
from orders.sql.engine import build_engine, sqlite_file


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///:memory:",
        "sqlite:///file::memory:?uri=true",
    ],
)
def test_a_memory_database_has_no_file_to_watch(url: str) -> None:
    engine = build_engine(Settings(database_url=url), url)
    try:
        assert sqlite_file(engine) is None
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("url", "relative"),
    [
        ("sqlite:///orders.db", "orders.db"),
        ("sqlite:///file:data/orders.db?uri=true", "data/orders.db"),
        ("sqlite:///my%20home/orders.db", "my home/orders.db"),
    ],
)
def test_a_file_database_is_watched_at_its_absolute_path(url: str, relative: str) -> None:
    engine = build_engine(Settings(database_url=url), url)
    try:
        assert sqlite_file(engine) == os.path.abspath(relative)
    finally:
        engine.dispose()
