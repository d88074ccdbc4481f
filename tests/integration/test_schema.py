"""The schema: Alembic migrations match the models, run from code and from the CLI.

Every test uses its own SQLite file under ``tmp_path``; the CLI runs as a subprocess from
the repository root, reading the database URL from ``ORDERS_DATABASE_URL`` like the service.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, inspect, select

from orders.config import Settings
from orders.errors import SchemaNotReady, StoreUnavailable, UnpaidOrderLimitReached
from orders.service import OrderService
from orders.sql import migrate
from orders.sql.direct import Compiled
from orders.sql.models import events_table, orders_table
from orders.sql.schema_names import unprefixed
from orders.sql.stats import collect_stats
from tests.support.clocks import ManualClock
from tests.support.plans import explain_sql
from tests.support.processes import child_env, run_python
from tests.support.stores import schema_differences, upgrade_to_head

REPO_ROOT = Path(__file__).resolve().parents[2]
TABLES = {orders_table.name, events_table.name}
ORDERS_INDEXES = {
    "ix_oes_orders_unpaid_expires_at_ms": ["expires_at_ms"],
    "ix_oes_orders_unpaid_user_id_expires_at_ms": ["user_id", "expires_at_ms"],
}
#: The partial indexes over one terminal status each (migration 0005), for the stats.
TERMINAL_INDEXES = {
    "ix_oes_orders_paid_paid_at_ms": (["paid_at_ms"], "paid"),
    "ix_oes_orders_cancelled_closed_at_ms": (["closed_at_ms"], "cancelled"),
    "ix_oes_orders_closed_closed_at_ms_expires_at_ms": (
        ["closed_at_ms", "expires_at_ms"],
        "closed",
    ),
}


def table_names(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def alembic_cli(*args: str, database_url: str, home: Path) -> subprocess.CompletedProcess[str]:
    # ORDERS_HOME: the embedded default, were it used, stays in tmp.
    env = child_env(ORDERS_DATABASE_URL=database_url, ORDERS_HOME=str(home))
    return run_python("-m", "alembic", *args, env=env, cwd=REPO_ROOT)


# --- migrations against the models ----------------------------------------------------------


def test_upgrade_head_on_an_empty_database_matches_the_models(empty_engine: Engine) -> None:
    migrate.upgrade(empty_engine)

    assert table_names(empty_engine) >= TABLES
    assert schema_differences(empty_engine) == []


def test_alembic_cli_reads_the_database_url_from_the_service_settings(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    url = f"sqlite:///{db}"

    upgraded = alembic_cli("upgrade", "head", database_url=url, home=tmp_path / "home")
    assert upgraded.returncode == 0, upgraded.stderr
    checked = alembic_cli("check", database_url=url, home=tmp_path / "home")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    assert db.exists()  # the URL came from ORDERS_DATABASE_URL, not from alembic.ini
    assert not (tmp_path / "home").exists()
    engine = create_engine(url)
    try:
        assert table_names(engine) >= TABLES
        assert migrate.current_revision(engine) == migrate.head_revision()
        assert schema_differences(engine) == []
    finally:
        engine.dispose()


def test_downgrade_to_base_drops_both_tables_and_upgrade_brings_them_back(
    empty_engine: Engine,
) -> None:
    migrate.upgrade(empty_engine)
    assert table_names(empty_engine) >= TABLES

    migrate.downgrade(empty_engine, "base")
    assert not TABLES & table_names(empty_engine)
    assert migrate.current_revision(empty_engine) is None
    assert not migrate.is_current(empty_engine)

    migrate.upgrade(empty_engine)
    assert table_names(empty_engine) >= TABLES
    assert migrate.is_current(empty_engine)
    assert schema_differences(empty_engine) == []


def test_is_current_is_false_on_an_empty_database_and_true_after_upgrade(
    empty_engine: Engine,
) -> None:
    assert migrate.current_revision(empty_engine) is None
    assert migrate.is_current(empty_engine) is False

    migrate.upgrade(empty_engine)

    assert migrate.is_current(empty_engine) is True
    assert migrate.current_revision(empty_engine) == migrate.head_revision()


def test_head_revision_is_the_newest_script_in_migrations_versions() -> None:
    scripts = ScriptDirectory(str(REPO_ROOT / "migrations"))
    heads = scripts.get_heads()

    assert len(heads) == 1
    assert migrate.head_revision() == heads[0]
    files = sorted(p.name for p in (REPO_ROOT / "migrations" / "versions").glob("[0-9]*.py"))
    newest = scripts.get_revision(heads[0])
    assert newest is not None
    assert newest.path is not None
    assert Path(newest.path).name == files[-1]


def test_the_sweep_and_limit_guard_indexes_are_partial_over_unpaid_orders(engine: Engine) -> None:
    indexes = {ix["name"]: ix for ix in inspect(engine).get_indexes(orders_table.name)}

    for name, columns in ORDERS_INDEXES.items():
        assert indexes[name]["column_names"] == columns
        where = str(indexes[name].get("dialect_options", {}).get(f"{engine.dialect.name}_where"))
        assert "status" in where
        assert "unpaid" in where


def test_the_stats_indexes_are_partial_over_one_terminal_status_each(engine: Engine) -> None:
    indexes = {ix["name"]: ix for ix in inspect(engine).get_indexes(orders_table.name)}

    for name, (columns, status) in TERMINAL_INDEXES.items():
        assert indexes[name]["column_names"] == columns
        where = str(indexes[name].get("dialect_options", {}).get(f"{engine.dialect.name}_where"))
        assert "status" in where
        assert status in where


def test_downgrade_from_head_to_0004_drops_only_the_stats_indexes(empty_engine: Engine) -> None:
    migrate.upgrade(empty_engine)
    migrate.downgrade(empty_engine, "0004")

    # Below 0007 the names are the bare ones again (nothing else took them).
    bare = inspect(empty_engine).get_indexes(unprefixed(orders_table.name))
    names = {unprefixed(str(ix["name"])) for ix in bare}
    assert not names & {unprefixed(name) for name in TERMINAL_INDEXES}
    assert names >= {unprefixed(name) for name in ORDERS_INDEXES}

    upgrade_to_head(empty_engine)


def test_upgrade_to_0006_numbers_each_users_unpaid_orders_in_expiry_order(
    empty_engine: Engine, redis_client: redis.Redis
) -> None:
    """Orders written before the slot guard get slots 1, 2, ... per user, soonest expiry
    first; the others none; and the guard then holds on the upgraded data."""
    migrate.upgrade(empty_engine, "0005")
    now = 1_800_000_000_000
    rows = [
        ("a-late", "a", "unpaid", now + 30_000),
        ("a-soon", "a", "unpaid", now + 10_000),
        ("a-paid", "a", "paid", now + 5_000),
        ("a-mid", "a", "unpaid", now + 20_000),
        ("b-only", "b", "unpaid", now + 10_000),
    ]
    with empty_engine.begin() as conn:
        for oid, user, status, expires in rows:
            conn.execute(
                orders_table.insert().values(
                    id=oid,
                    user_id=user,
                    status=status,
                    created_at_ms=now,
                    expires_at_ms=expires,
                    updated_at_ms=now,
                )
            )

    upgrade_to_head(empty_engine)

    with empty_engine.connect() as conn:
        slots = dict(conn.execute(select(orders_table.c.id, orders_table.c.slot)).all())
    assert slots == {"a-soon": 1, "a-mid": 2, "a-late": 3, "a-paid": None, "b-only": 1}
    service = OrderService(empty_engine, redis_client, Settings(), clock=lambda: now)
    with pytest.raises(UnpaidOrderLimitReached) as refused:  # Redis knows none of them
        service.create_unpaid_order("a")
    assert refused.value.source == "sql"
    assert service.create_unpaid_order("b").id not in slots


def statements_run_by(engine: Engine, action: Callable[[], object]) -> list[tuple[str, Any]]:
    """Every (SQL, parameters) pair the driver is handed while ``action`` runs: SQLAlchemy's
    (its cursor event) and those sent straight to the driver (``orders.sql.direct``)."""
    seen: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, sql: str, params: Any, *_rest: Any) -> None:
        seen.append((sql, params))

    def noted(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Compiled, conn: Any, params: Any) -> Any:
            bound = self.parameters(params)  # sqlite3's: a list in the statement's order
            seen.append((self.sql, tuple(bound) if isinstance(bound, list) else bound))
            return method(self, conn, params)

        return run

    run, execute = Compiled.run, Compiled.execute
    event.listen(engine, "before_cursor_execute", capture)
    Compiled.run, Compiled.execute = noted(run), noted(execute)  # type: ignore[method-assign]
    try:
        action()
    finally:
        Compiled.run, Compiled.execute = run, execute  # type: ignore[method-assign]
        event.remove(engine, "before_cursor_execute", capture)
    return seen


def the_one(statements: list[tuple[str, Any]], marker: str) -> tuple[str, Any]:
    found = [(sql, params) for sql, params in statements if marker in sql.lower()]
    assert len(found) == 1, [sql for sql, _ in statements]
    return found[0]


def test_the_services_own_sweep_and_limit_guard_use_the_partial_indexes(
    engine: Engine, service: OrderService, clock: Any
) -> None:
    """Plans the statements the service itself sends, captured from the driver: a guard or
    sweep rewritten so that no partial index can serve it (the status as a bound parameter,
    say) fails here."""
    service.create_unpaid_order("u0", ttl_s=1)
    clock.advance(s=2)
    guard_sql, guard_params = the_one(
        statements_run_by(engine, lambda: service.create_unpaid_order("u1", ttl_s=60)),
        f"insert into {orders_table.name}",
    )
    sweep_sql, sweep_params = the_one(
        statements_run_by(engine, service.sweep_expired), "with due as"
    )

    assert "ix_oes_orders_unpaid_user_id_slot" in explain_sql(engine, guard_sql, guard_params)
    assert "ix_oes_orders_unpaid_expires_at_ms" in explain_sql(engine, sweep_sql, sweep_params)


def full_scans_of_orders(engine: Engine, plan: str) -> list[str]:
    """The plan's lines that read the orders table without an index."""
    if engine.dialect.name == "sqlite":
        return [
            line for line in plan.splitlines() if orders_table.name in line and "INDEX" not in line
        ]
    return [line for line in plan.splitlines() if "Seq Scan" in line]


def test_every_stats_query_is_served_by_an_index(
    engine: Engine, service: OrderService, clock: Any
) -> None:
    """Plans the statements ``orders stats`` sends, captured from the driver: a stats query
    that needs the whole table (a predicate no index serves, a status as a bound parameter
    that a partial index cannot match in a generic plan) fails here."""
    paid = service.create_unpaid_order("u0", ttl_s=60)
    service.mark_paid(paid.id)
    service.cancel_order(service.create_unpaid_order("u1", ttl_s=60).id)
    service.create_unpaid_order("u2", ttl_s=1)
    service.create_unpaid_order("u3", ttl_s=300)
    clock.advance(s=2)
    service.sweep_expired()
    statements = statements_run_by(engine, lambda: collect_stats(service.engine, service.clock))
    assert len(statements) == 5, [sql for sql, _ in statements]
    # The users with their own limit: a count of oes_user_limits, one row per such user.
    assert the_one(statements, "from oes_user_limits")

    plans = {
        "unpaid": the_one(statements, "filter (where"),
        "paid and cancelled": the_one(statements, "paid_at_ms"),
        "close lag": the_one(statements, "case when"),
        "expiries ahead": the_one(statements, "slot"),
    }
    planned = {what: explain_sql(engine, *statement) for what, statement in plans.items()}

    for what, plan in planned.items():
        assert full_scans_of_orders(engine, plan) == [], (what, plan)
    assert "ix_oes_orders_unpaid_" in planned["unpaid"]
    assert "ix_oes_orders_paid_paid_at_ms" in planned["paid and cancelled"]
    assert "ix_oes_orders_cancelled_closed_at_ms" in planned["paid and cancelled"]
    assert "ix_oes_orders_reminded_reminded_at_ms" in planned["paid and cancelled"]
    assert "ix_oes_orders_closed_closed_at_ms_expires_at_ms" in planned["close lag"]
    # Either partial index over unpaid orders will do (on a small table PostgreSQL may read
    # the one led by user_id whole): both hold unpaid orders only.
    assert "ix_oes_orders_unpaid_" in planned["expiries ahead"]
    if engine.dialect.name == "postgresql":
        # The lag is read from the index alone, never from the table's rows. (SQLite 3.40
        # still visits the rows, for the status the partial index already implies.)
        assert "Index Only Scan" in planned["close lag"]


# --- the service on a database without the schema -------------------------------------------


def test_service_on_an_unmigrated_database_refuses_with_schema_not_ready_and_no_member(
    empty_engine: Engine, empty_url: str, redis_client: redis.Redis, clock: ManualClock
) -> None:
    service = OrderService(
        empty_engine, redis_client, Settings(database_url=empty_url), clock=clock
    )

    with pytest.raises(SchemaNotReady) as refused:
        service.create_unpaid_order("early-bird")

    assert isinstance(refused.value, StoreUnavailable)
    assert refused.value.store == "sql"
    assert "orders db upgrade" in str(refused.value)
    assert service.index.members("early-bird") == {}
    assert redis_client.exists(service.index.key("early-bird")) == 0
    assert orders_table.name not in table_names(empty_engine)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda s: s.get_order("o-1"), id="get_order"),
        pytest.param(lambda s: s.list_unpaid("u-1"), id="list_unpaid"),
        pytest.param(lambda s: s.mark_paid("o-1"), id="mark_paid"),
        pytest.param(lambda s: s.cancel_order("o-1"), id="cancel_order"),
        pytest.param(lambda s: s.sweep_expired(), id="sweep_expired"),
    ],
)
def test_every_use_case_on_an_unmigrated_database_raises_schema_not_ready(
    empty_engine: Engine,
    empty_url: str,
    redis_client: redis.Redis,
    clock: ManualClock,
    call: object,
) -> None:
    service = OrderService(
        empty_engine, redis_client, Settings(database_url=empty_url), clock=clock
    )

    with pytest.raises(SchemaNotReady, match="orders db upgrade"):
        call(service)  # type: ignore[operator]

    assert redis_client.dbsize() == 0


def test_service_works_once_the_empty_database_is_upgraded(
    empty_engine: Engine, empty_url: str, redis_client: redis.Redis, clock: ManualClock
) -> None:
    service = OrderService(
        empty_engine, redis_client, Settings(database_url=empty_url), clock=clock
    )
    with pytest.raises(SchemaNotReady):
        service.create_unpaid_order("early-bird")

    migrate.upgrade(empty_engine)
    order = service.create_unpaid_order("early-bird")

    with empty_engine.connect() as conn:
        ids = conn.execute(select(orders_table.c.id)).scalars().all()
    assert ids == [order.id]
    assert service.index.members("early-bird") == {order.id: order.expires_at_ms}
