"""``connection=``: creates, payments and cancels in the host's own transaction.

Each test ends by reading both stores: the SQL rows (the order, its events, the host's own
row) and the user's Redis members. The host's table is one of the test's, beside the
service's tables in the same database, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, func, select
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from orders.bootstrap import build_async_engine, build_engine
from orders.config import Settings
from orders.domain import OrderStatus
from orders.errors import InvalidInput, OrderNotFound, UnpaidOrderLimitReached
from orders.index.admissions import SUSPECT_AFTER_MS
from orders.service import OrderService
from orders.sql import host as host_tx
from orders.sql.models import orders_table
from tests.support.clocks import ManualClock
from tests.support.host_app import (
    Boom,
    admission_notes,
    cart_count,
    cart_insert,
    event_kinds,
    host_tables,
    members,
    open_orders,
    sql_status,
)


@pytest.fixture
def carts(engine: Engine) -> Iterator[None]:
    with host_tables(engine):
        yield


def add_cart(conn: Connection | Session, user_id: str) -> None:
    conn.execute(cart_insert(user_id))


# --- create -----------------------------------------------------------------------------------


@pytest.mark.usefixtures("carts")
def test_create_in_committed_host_transaction_keeps_order_cart_and_member(
    service: OrderService, engine: Engine
) -> None:
    with engine.connect() as conn:
        add_cart(conn, "u1")
        order = service.create_unpaid_order("u1", connection=conn)
        assert members(service, "u1") == {order.id}  # admitted before the insert
        assert host_tx.pending(conn) == 1
        conn.commit()
        assert host_tx.pending(conn) == 0
    assert sql_status(engine, order.id) == "unpaid"
    assert event_kinds(engine, order.id) == ["created"]
    assert cart_count(engine, "u1") == 1
    assert members(service, "u1") == {order.id}


def test_a_refusal_keeps_the_member_of_a_create_whose_host_transaction_is_still_open(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    # Older than the suspects' age, no row to be seen: but its transaction is alive
    # (PostgreSQL: its in-flight lock is held; SQLite: the write lock is), so it counts.
    with engine.connect() as conn:
        order = service.create_unpaid_order("u1", limit=1, connection=conn)
        clock.advance(ms=SUSPECT_AFTER_MS)
        with pytest.raises(UnpaidOrderLimitReached):
            service.create_unpaid_order("u1", limit=1)
        assert members(service, "u1") == {order.id}
        conn.commit()
    assert members(service, "u1") == {order.id}
    assert sql_status(engine, order.id) == "unpaid"


@pytest.mark.usefixtures("carts")
def test_create_in_rolled_back_host_transaction_leaves_nothing_in_either_store(
    service: OrderService, engine: Engine
) -> None:
    with engine.connect() as conn:
        add_cart(conn, "u1")
        order = service.create_unpaid_order("u1", connection=conn)
        conn.rollback()
    assert sql_status(engine, order.id) is None
    assert event_kinds(engine, order.id) == []
    assert cart_count(engine, "u1") == 0
    assert members(service, "u1") == set()
    assert admission_notes(service, "u1") == set()


@pytest.mark.usefixtures("carts")
def test_create_in_host_connection_closed_without_commit_is_rolled_back(
    service: OrderService, engine: Engine
) -> None:
    with engine.connect() as conn:
        order = service.create_unpaid_order("u1", connection=conn)
    assert sql_status(engine, order.id) is None
    assert members(service, "u1") == set()


@pytest.mark.usefixtures("carts")
def test_exception_inside_host_session_block_takes_the_order_back(
    service: OrderService, engine: Engine
) -> None:
    created: list[str] = []

    def checkout() -> None:
        with Session(engine) as session, session.begin():
            add_cart(session, "u1")
            created.append(service.create_unpaid_order("u1", connection=session).id)
            raise Boom

    with pytest.raises(Boom):
        checkout()
    assert sql_status(engine, created[0]) is None
    assert cart_count(engine, "u1") == 0
    assert members(service, "u1") == set()


@pytest.mark.usefixtures("carts")
def test_host_session_commit_keeps_order_and_cart_together(
    service: OrderService, engine: Engine
) -> None:
    with Session(engine) as session, session.begin():
        add_cart(session, "u1")
        order = service.create_unpaid_order("u1", connection=session)
    assert sql_status(engine, order.id) == "unpaid"
    assert cart_count(engine, "u1") == 1
    assert members(service, "u1") == {order.id}


@pytest.mark.usefixtures("carts")
def test_rolled_back_savepoint_takes_back_only_the_create_inside_it(
    service: OrderService, engine: Engine
) -> None:
    with engine.connect() as conn:
        add_cart(conn, "u1")  # SQLite's driver begins the transaction at the first write
        savepoint = conn.begin_nested()
        inside = service.create_unpaid_order("u1", connection=conn)
        savepoint.rollback()
        after = service.create_unpaid_order("u1", connection=conn)
        later = conn.begin_nested()  # begun after the create: cannot undo it
        later.rollback()
        conn.commit()
    assert sql_status(engine, inside.id) is None
    assert sql_status(engine, after.id) == "unpaid"
    assert members(service, "u1") == {after.id}
    assert cart_count(engine, "u1") == 1


def test_rolling_back_a_savepoint_undoes_in_redis_only_the_steps_written_inside_it(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    """Rule: rolling back a savepoint of the host's transaction undoes, in Redis, only the
    steps written inside that savepoint: creates and payments before it, after it, and in
    the released savepoint around it keep their Redis steps."""
    service = make_service(unpaid_limit=10)
    paid_outside = service.create_unpaid_order("u1")
    paid_inside = service.create_unpaid_order("u1")
    with engine.connect() as conn:
        before = service.create_unpaid_order("u1", connection=conn).id
        service.mark_paid(paid_outside.id, payment_ref="p-out", connection=conn)
        released = conn.begin_nested()
        in_released = service.create_unpaid_order("u1", connection=conn).id
        savepoint = conn.begin_nested()
        inside = service.create_unpaid_order("u1", connection=conn).id
        service.mark_paid(paid_inside.id, payment_ref="p-in", connection=conn)
        savepoint.rollback()
        after_in_released = service.create_unpaid_order("u1", connection=conn).id
        released.commit()
        conn.begin_nested().rollback()  # begun after every step: undoes none of them
        after = service.create_unpaid_order("u1", connection=conn).id
        conn.commit()
    kept = {before, in_released, after_in_released, after, paid_inside.id}
    assert members(service, "u1") == kept
    assert open_orders(engine) == {"u1": kept}
    assert sql_status(engine, inside) is None
    assert sql_status(engine, paid_outside.id) == "paid"
    assert event_kinds(engine, paid_inside.id) == ["created"]


@pytest.mark.usefixtures("carts")
@pytest.mark.parametrize("outer", ["commit", "rollback"])
def test_released_savepoint_hands_the_create_to_the_outer_transaction(
    service: OrderService, engine: Engine, outer: str
) -> None:
    with engine.connect() as conn:
        add_cart(conn, "u1")
        with conn.begin_nested():
            order = service.create_unpaid_order("u1", connection=conn)
        assert members(service, "u1") == {order.id}  # released: still the outer's to decide
        getattr(conn, outer)()
    kept = outer == "commit"
    assert sql_status(engine, order.id) == ("unpaid" if kept else None)
    assert members(service, "u1") == ({order.id} if kept else set())
    assert cart_count(engine, "u1") == (1 if kept else 0)


@pytest.mark.usefixtures("carts")
def test_session_savepoint_rolled_back_takes_its_create_back(
    service: OrderService, engine: Engine
) -> None:
    with Session(engine) as session:
        add_cart(session, "u1")
        nested = session.begin_nested()
        inside = service.create_unpaid_order("u1", connection=session)
        nested.rollback()
        kept = service.create_unpaid_order("u1", connection=session)
        session.commit()
    assert sql_status(engine, inside.id) is None
    assert sql_status(engine, kept.id) == "unpaid"
    assert members(service, "u1") == {kept.id}


@pytest.mark.usefixtures("carts")
def test_refused_create_in_host_transaction_leaves_the_host_free_to_go_on(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=1)
    first = service.create_unpaid_order("u1")
    paid = service.mark_paid(service.create_unpaid_order("u2", order_id="paid-1").id)
    with engine.connect() as conn:
        add_cart(conn, "u1")
        with pytest.raises(UnpaidOrderLimitReached):
            service.create_unpaid_order("u1", connection=conn)
        # Retries of existing ids: the same orders back. The paid one's id is refused by
        # the primary key (in a savepoint on PostgreSQL: else the whole host transaction
        # would be aborted), and the host's transaction goes on.
        assert service.create_unpaid_order("u1", order_id=first.id, connection=conn) == first
        again = service.create_unpaid_order("u2", order_id=paid.id, connection=conn)
        assert again.status is OrderStatus.PAID
        add_cart(conn, "u2")
        conn.commit()
    assert (cart_count(engine, "u1"), cart_count(engine, "u2")) == (1, 1)
    assert members(service, "u1") == {first.id}
    assert members(service, "u2") == set()
    assert admission_notes(service, "u2") == set()  # the retry's admission taken back


# --- pay and cancel ------------------------------------------------------------------------


@pytest.mark.parametrize("use_case", ["mark_paid", "cancel_order"])
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_transition_in_host_transaction_leaves_redis_only_when_the_host_commits(
    service: OrderService, engine: Engine, use_case: str, outcome: str
) -> None:
    order = service.create_unpaid_order("u1")
    with engine.connect() as conn:
        getattr(service, use_case)(order.id, connection=conn)
        assert members(service, "u1") == {order.id}  # not before the host's commit
        getattr(conn, outcome)()
    if outcome == "commit":
        status = OrderStatus.PAID if use_case == "mark_paid" else OrderStatus.CANCELLED
        assert sql_status(engine, order.id) == status.value
        assert members(service, "u1") == set()
    else:
        assert sql_status(engine, order.id) == "unpaid"
        assert event_kinds(engine, order.id) == ["created"]
        assert members(service, "u1") == {order.id}


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_payment_for_a_missing_order_records_its_refusal_in_the_host_transaction(
    service: OrderService, engine: Engine, outcome: str
) -> None:
    with engine.connect() as conn:
        with pytest.raises(OrderNotFound):
            service.mark_paid("o-gone", payment_ref="p-1", connection=conn)
        getattr(conn, outcome)()
    owed = [(r.order_id, r.reason.value) for r in service.refused_payments()]
    assert owed == ([("o-gone", "unknown_order")] if outcome == "commit" else [])


def test_create_and_pay_in_one_host_transaction(service: OrderService, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        order = service.create_unpaid_order("u1", connection=session)
        paid = service.mark_paid(order.id, payment_ref="p-1", connection=session)
        assert paid.status is OrderStatus.PAID
    assert event_kinds(engine, order.id) == ["created", "paid"]
    assert members(service, "u1") == set()


def test_long_lived_connection_keeps_no_follower_and_no_listener_per_transaction(
    service: OrderService, engine: Engine
) -> None:
    with engine.connect() as conn:
        order = service.create_unpaid_order("u1", connection=conn)
        conn.commit()
        listeners = {name: len(getattr(engine.dispatch, name)) for name in ("commit", "rollback")}
        for round_no in range(20):
            order = service.create_unpaid_order(f"u{round_no}", connection=conn)
            service.mark_paid(order.id, connection=conn)
            with conn.begin_nested():
                service.create_unpaid_order(f"u{round_no}", connection=conn)
            (conn.commit if round_no % 2 else conn.rollback)()
            assert host_tx.pending(conn) == 0
        assert conn not in host_tx.FOLLOWERS
        after = {name: len(getattr(engine.dispatch, name)) for name in ("commit", "rollback")}
        assert after == listeners


def test_follow_up_that_fails_is_logged_never_raised_into_the_commit(
    service: OrderService, engine: Engine, logs: pytest.LogCaptureFixture
) -> None:
    order = service.create_unpaid_order("u1")

    def broken() -> None:
        raise RuntimeError("redis gone")

    with engine.connect() as conn:
        service.mark_paid(order.id, connection=conn)
        host_tx.follow(conn, on_commit=broken)
        conn.commit()
    assert sql_status(engine, order.id) == "paid"
    assert members(service, "u1") == set()  # the service's own step still ran
    assert "follow-up of a host's transaction failed" in logs.text


# --- bad input ----------------------------------------------------------------------------------


def nothing_written(service: OrderService, engine: Engine) -> bool:
    with engine.connect() as conn:
        rows = conn.execute(select(func.count()).select_from(orders_table)).scalar_one()
    return rows == 0 and members(service, "u1") == set() and admission_notes(service, "u1") == set()


def test_closed_connection_is_refused_before_anything_is_written(
    service: OrderService, engine: Engine
) -> None:
    conn = engine.connect()
    conn.close()
    with pytest.raises(InvalidInput, match="connection: is closed"):
        service.create_unpaid_order("u1", connection=conn)
    assert nothing_written(service, engine)


def test_engine_where_a_connection_is_expected_is_refused(
    service: OrderService, engine: Engine
) -> None:
    with pytest.raises(InvalidInput, match="an Engine"):
        service.create_unpaid_order("u1", connection=engine)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="Connection or Session, not str"):
        service.mark_paid("o-1", connection="sqlite://")  # type: ignore[arg-type]
    assert nothing_written(service, engine)


def test_connection_to_another_database_is_refused_without_its_password(
    service: OrderService, engine: Engine, tmp_path: Path
) -> None:
    other_sqlite = build_engine(Settings(database_url=f"sqlite:///{tmp_path / 'other.db'}"))
    other_pg = sa_create_engine("postgresql+psycopg://shop:s3cret@db.example:5433/shop")
    try:
        for other in (other_sqlite, other_pg):
            with (
                Session(other) as session,
                pytest.raises(InvalidInput, match="another database") as refused,
            ):
                service.create_unpaid_order("u1", connection=session)
            assert "s3cret" not in str(refused.value)
            assert "shop:" not in str(refused.value)
        with other_sqlite.connect() as conn, pytest.raises(InvalidInput, match="another database"):
            service.cancel_order("o-1", connection=conn)
        with pytest.raises(InvalidInput, match="bound to no engine"):
            service.create_unpaid_order("u1", connection=Session())
    finally:
        other_sqlite.dispose()
        other_pg.dispose()
    assert nothing_written(service, engine)


def test_other_engine_on_the_same_database_is_accepted(
    service: OrderService, engine: Engine, database_url: str
) -> None:
    second = build_engine(Settings(database_url=database_url))
    try:
        with second.connect() as conn:
            order = service.create_unpaid_order("u1", connection=conn)
            conn.commit()
    finally:
        second.dispose()
    assert sql_status(engine, order.id) == "unpaid"
    assert members(service, "u1") == {order.id}


def test_async_connection_given_to_the_sync_api_is_refused(
    service: OrderService, engine: Engine, database_url: str
) -> None:
    async_engine = build_async_engine(Settings(database_url=database_url))
    with pytest.raises(InvalidInput, match=r"AsyncSession is for orders\.aio"):
        service.create_unpaid_order("u1", connection=AsyncSession(async_engine))  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="an Engine"):
        service.create_unpaid_order("u1", connection=async_engine)  # type: ignore[arg-type]
    async_engine.sync_engine.dispose()
    assert nothing_written(service, engine)


def test_autocommit_connection_is_refused(service: OrderService, engine: Engine) -> None:
    with engine.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(InvalidInput, match="autocommit"):
            service.create_unpaid_order("u1", connection=auto)
    assert nothing_written(service, engine)


def test_order_not_found_in_host_transaction_is_typed(
    service: OrderService, engine: Engine
) -> None:
    with engine.connect() as conn, pytest.raises(OrderNotFound):
        service.mark_paid("no-such-order", connection=conn)
