"""Two ``orders db upgrade`` processes started at once on an empty database, and on one the
previous release migrated (its revision in ``alembic_version``, the bare table names).

A deploy that runs the upgrade from every replica's start-up does this. Both must exit 0
and leave the schema at head with one row in our version table: the migration lock
(``orders.sql.migrate.migration_lock``) makes the second wait for the first, and Alembic
then reads the revision under that lock and finds nothing to do. The move of the previous
release's revision out of ``alembic_version`` runs under the same lock, so the second
finds it moved, and every row the previous release wrote is there once, renamed with its
table. Without the lock the
loser failed on the winner's tables ("table ... already exists" on SQLite, a unique
violation in PostgreSQL's catalog) and exited 8.

Each round is a fresh empty database; the race needs the two migrations to overlap, which
process start-up does not always allow, so there are several rounds. Before the lock, runs
of 6 rounds went red on SQLite in 3 of 4 (each in round 0) and on PostgreSQL in 2 of 3
(rounds 3 and 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, String, column, func, inspect, select, table

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.sql import migrate
from orders.sql.schema_names import LEGACY_VERSION_TABLE, VERSION_TABLE, prefixed
from tests.support.processes import ChildProcess, child_env
from tests.support.schemas import PREVIOUS_ROWS, as_previous_release, as_rows_were, rows_of
from tests.support.stores import schema_differences

UPGRADERS = 2
ROUNDS = {"empty": 4, "previous release": 2}  # CI time: 20 each with --full
FULL_ROUNDS = 20


@pytest.fixture(params=["sqlite", "postgresql"])
def new_empty_database(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[int], str]]:
    """Makes a database without any schema per round, on each engine; drops them at the end."""
    if request.param == "sqlite":
        yield lambda n: f"sqlite:///{tmp_path / f'round-{n}.db'}"
        return
    target, _ = request.getfixturevalue("postgres_template")
    made: list[str] = []

    def make(_n: int) -> str:
        made.append(target.new_database())
        return str(target.url(made[-1]))

    try:
        yield make
    finally:
        for name in made:
            target.drop_database(name)


def previous_release(url: str) -> dict[str, list[tuple[object, ...]]]:
    """Make ``url``'s empty database what the previous release left; its rows, renamed."""
    engine = build_engine(Settings(database_url=url))
    try:
        migrate.upgrade(engine)
        as_previous_release(engine)
        return {prefixed(t): rows for t, rows in rows_of(engine, list(PREVIOUS_ROWS)).items()}
    finally:
        engine.dispose()


def version_rows(engine: Engine) -> list[tuple[object, ...]]:
    version_num = column("version_num", String)
    with engine.connect() as conn:
        rows = conn.execute(
            select(version_num, func.count())
            .select_from(table(VERSION_TABLE))
            .group_by(version_num)
        ).all()
    return [tuple(row) for row in rows]


@pytest.mark.timeout(300)  # a round is two interpreter start-ups: 2 to 10 s under load
# Each starting point on one engine, the next on the other (CI time; --full runs all four).
@pytest.mark.rotate("new_empty_database")
@pytest.mark.parametrize("start", list(ROUNDS))
def test_two_upgrades_at_once_both_exit_0_with_the_schema_at_head_once(
    new_empty_database: Callable[[int], str], tmp_path: Path, full_size: bool, start: str
) -> None:
    head = migrate.head_revision()
    for n in range(FULL_ROUNDS if full_size else ROUNDS[start]):
        url = new_empty_database(n)
        rows = previous_release(url) if start == "previous release" else {}
        env = child_env(ORDERS_DATABASE_URL=url, ORDERS_HOME=str(tmp_path / "home"))
        upgraders = [
            ChildProcess(["-m", "orders", "db", "upgrade"], env, tmp_path / f"upgrade-{n}-{i}.log")
            for i in range(UPGRADERS)
        ]
        try:
            codes = [child.proc.wait(90) for child in upgraders]
            failed = [child for child, code in zip(upgraders, codes, strict=True) if code != 0]
            if failed:
                raise failed[0].fail(f"round {n}: exit codes {codes}")
        finally:
            for child in upgraders:
                child.close()

        engine = build_engine(Settings(database_url=url))
        try:
            assert version_rows(engine) == [(head, 1)], f"round {n}"
            assert LEGACY_VERSION_TABLE not in inspect(engine).get_table_names(), f"round {n}"
            assert as_rows_were(rows_of(engine, list(rows)), rows) == rows, f"round {n}"
            assert schema_differences(engine) == [], f"round {n}"
        finally:
            engine.dispose()
