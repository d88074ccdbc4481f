"""``connection=`` on orders.aio: the host's AsyncConnection or AsyncSession, on a checked
loop (no callback over 20 ms), on SQLite and PostgreSQL. The rules are the synchronous
core's (tests/integration/test_host_transaction.py); these prove the async side reaches
them: the writes in the host's transaction, and Redis following its end from within the
host's own awaited commit or rollback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from orders.aio import AsyncOrderService
from orders.config import Settings
from orders.errors import InvalidInput
from orders.service import OrderService
from tests.support.aio import new_async_service, run_checked
from tests.support.host_app import (
    Boom,
    admission_notes,
    cart_count,
    cart_insert,
    event_kinds,
    host_tables,
    members,
    sql_status,
)


@pytest.fixture
def settings(
    database_url: str, redis_options: dict[str, Any], engine: Engine
) -> Iterator[Settings]:
    with host_tables(engine):
        yield Settings(database_url=database_url, **redis_options)


@pytest.fixture
def sync_service(settings: Settings, engine: Engine, redis_client: Any) -> OrderService:
    """The same stores read synchronously at the end of a test."""
    return OrderService(engine, redis_client, settings)


def run_with(settings: Settings, body: Any) -> Any:
    async def main() -> Any:
        service = await new_async_service(settings)
        try:
            return await body(service)
        finally:
            await service.aclose()

    return run_checked(main())


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_async_connection_create_follows_the_host_outcome(
    settings: Settings, sync_service: OrderService, engine: Engine, outcome: str
) -> None:
    async def body(service: AsyncOrderService) -> str:
        async with service.engine.connect() as conn:
            await conn.execute(cart_insert("u1"))
            order = await service.create_unpaid_order("u1", connection=conn)
            await getattr(conn, outcome)()
        return order.id

    order_id = run_with(settings, body)
    kept = outcome == "commit"
    assert sql_status(engine, order_id) == ("unpaid" if kept else None)
    assert cart_count(engine, "u1") == (1 if kept else 0)
    assert members(sync_service, "u1") == ({order_id} if kept else set())
    assert admission_notes(sync_service, "u1") == ({order_id} if kept else set())


def test_async_session_exception_in_block_takes_create_back(
    settings: Settings, sync_service: OrderService, engine: Engine
) -> None:
    created: list[str] = []

    async def body(service: AsyncOrderService) -> None:
        async with AsyncSession(service.engine) as session, session.begin():
            await session.execute(cart_insert("u1"))
            created.append((await service.create_unpaid_order("u1", connection=session)).id)
            raise Boom

    with pytest.raises(Boom):
        run_with(settings, body)
    assert sql_status(engine, created[0]) is None
    assert cart_count(engine, "u1") == 0
    assert members(sync_service, "u1") == set()


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_async_session_payment_leaves_redis_only_on_commit(
    settings: Settings, sync_service: OrderService, engine: Engine, outcome: str
) -> None:
    async def body(service: AsyncOrderService) -> str:
        order = await service.create_unpaid_order("u1")
        async with AsyncSession(service.engine) as session:
            await service.mark_paid(order.id, payment_ref="p-1", connection=session)
            await getattr(session, outcome)()
        return order.id

    order_id = run_with(settings, body)
    paid = outcome == "commit"
    assert sql_status(engine, order_id) == ("paid" if paid else "unpaid")
    assert event_kinds(engine, order_id) == (["created", "paid"] if paid else ["created"])
    assert members(sync_service, "u1") == (set() if paid else {order_id})


def test_async_savepoint_rolled_back_takes_back_its_cancel_and_create(
    settings: Settings, sync_service: OrderService, engine: Engine
) -> None:
    async def body(service: AsyncOrderService) -> tuple[str, str]:
        first = await service.create_unpaid_order("u1")
        async with service.engine.connect() as conn:
            await conn.execute(cart_insert("u1"))
            savepoint = await conn.begin_nested()
            await service.cancel_order(first.id, connection=conn)
            inside = await service.create_unpaid_order("u1", connection=conn)
            await savepoint.rollback()
            await conn.commit()
        return first.id, inside.id

    first_id, inside_id = run_with(settings, body)
    assert sql_status(engine, first_id) == "unpaid"
    assert sql_status(engine, inside_id) is None
    assert cart_count(engine, "u1") == 1
    assert members(sync_service, "u1") == {first_id}


def test_sync_connection_or_engine_given_to_the_async_api_is_refused(
    settings: Settings, sync_service: OrderService, engine: Engine
) -> None:
    async def body(service: AsyncOrderService) -> None:
        with (
            engine.connect() as conn,
            pytest.raises(InvalidInput, match="AsyncConnection or AsyncSession, not Connection"),
        ):
            await service.create_unpaid_order("u1", connection=conn)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="not AsyncEngine"):
            await service.mark_paid("o-1", connection=service.engine)  # type: ignore[arg-type]
        closed = service.engine.connect()
        await closed.start()
        await closed.close()
        with pytest.raises(InvalidInput, match="is closed"):
            await service.cancel_order("o-1", connection=closed)
        with pytest.raises(InvalidInput, match="not started"):
            await service.cancel_order("o-1", connection=service.engine.connect())

    run_with(settings, body)
    assert members(sync_service, "u1") == set()
    assert admission_notes(sync_service, "u1") == set()
