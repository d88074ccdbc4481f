"""Which SQLite URLs name a file the engine watches (``orders.sql.engine.sqlite_file``):
a memory database has none, so it is exempt from the deleted-or-replaced check."""

from __future__ import annotations

import os
from pathlib import Path

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
    "url",
    [
        "sqlite:///orders.db",
        "sqlite:///file:data/orders.db?uri=true",
        # SQLAlchemy before 2.0.4x hands the driver "my%20home", later ones "my home": the
        # watched file must be the one the driver opened, whichever it is.
        "sqlite:///my%20home/orders.db",
    ],
)
def test_a_file_database_is_watched_at_its_absolute_path(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for folder in ("data", "my home", "my%20home"):
        (tmp_path / folder).mkdir()
    engine = build_engine(Settings(database_url=url), url)
    try:
        with engine.connect():
            pass  # the driver creates the file
        created = [str(path) for path in tmp_path.rglob("*.db")]
        assert created == [sqlite_file(engine)]
        assert os.path.isabs(created[0])
    finally:
        engine.dispose()
