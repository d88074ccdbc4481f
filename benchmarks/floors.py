"""The floors the figures hold the service against: what the same durable work costs
without it (a raw EVALSHA, the raw driver's statements, Core's), and the original
article's naive create (ZCARD, ZADD, INSERT)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import insert

from benchmarks.driver import RawDriver, writer_queue
from benchmarks.measure import Run, Variant, run_ops
from benchmarks.workload import Workload
from orders.domain import EventKind
from orders.index.admissions import admit_args
from orders.sql.models import events_table, orders_table

_INSERT_ORDER = insert(orders_table)
_INSERT_EVENT = insert(events_table)


def _admission_args(w: Workload) -> Callable[[str, int], list[str | int]]:
    """The admission script's ARGV for a new order of a new user at ``now``."""
    ttl, limit = w.ttl_ms, w.service.settings.unpaid_limit
    window_ms = w.service.index.window_ms

    def args(order_id: str, now: int) -> list[str | int]:
        return admit_args(
            order_id, expires_at_ms=now + ttl, now_ms=now, limit=limit, window_ms=window_ms
        )

    return args


def _check_admitted(reply: Any) -> None:
    if int(reply[0]) == -1:
        raise RuntimeError("raw admission refused a new user")


def _admit(w: Workload) -> Callable[[list[str], str, int], None]:
    """One raw EVALSHA of the admission script that must admit (a new user each time)."""
    client, sha, args = w.client, w.admit_sha, _admission_args(w)

    def admit(keys: list[str], order_id: str, now: int) -> None:
        _check_admitted(client.evalsha(sha, len(keys), *keys, *args(order_id, now)))

    return admit


def _admitted(
    w: Workload,
    kind: str,
    threads: int,
    write: Callable[[str, str, int, int], None],
    after_run: Callable[[], None] = lambda: None,
) -> Variant:
    """A raw EVALSHA that admits, then ``write(order_id, user_id, now_ms, expires_at_ms)``."""
    admit, clock, ttl = _admit(w), w.service.clock, w.ttl_ms

    def variant(n: int) -> Run:
        users, ids = w.users(kind, n), w.order_ids(n)
        keys = [w.admit_keys(u) for u in users]

        def op(i: int) -> None:
            now = clock()
            admit(keys[i], ids[i], now)
            write(ids[i], users[i], now, now + ttl)

        try:
            return run_ops(op, n, threads)
        finally:
            after_run()

    return variant


def floor(w: Workload, threads: int = 1) -> Variant:
    """The honest floor of a create: one EVALSHA of the admission script, then the raw
    driver writing the order row and its ``created`` event in one committed transaction."""
    driver = RawDriver(w.engine, w.connections(threads))
    return _admitted(w, "f", threads, driver.create, driver.release)


def floor_core(w: Workload, threads: int = 1) -> Variant:
    """The same work as :func:`floor` through SQLAlchemy Core: ``engine.begin()`` (a pooled
    connection) and two compiled-once INSERTs (on SQLite, queued as the floor's are)."""
    engine, writer = w.engine, writer_queue(w.engine)

    def write(order_id: str, user_id: str, now: int, expires_at_ms: int) -> None:
        with writer, engine.begin() as conn:
            conn.execute(_INSERT_ORDER, w.minimal_row(order_id, user_id, now, expires_at_ms))
            conn.execute(_INSERT_EVENT, w.created_event(order_id, user_id, now))

    return _admitted(w, "k", threads, write)


def _insert_one(w: Workload) -> Callable[[dict[str, Any]], None]:
    engine = w.engine

    def insert_one(row: dict[str, Any]) -> None:
        with engine.connect() as conn:
            conn.execute(_INSERT_ORDER, row)
            conn.commit()

    return insert_one


def naive(w: Workload, threads: int = 1) -> Variant:
    """The original article's create: ZCARD, then ZADD from the client, then INSERT."""
    client, insert_one, clock = w.client, _insert_one(w), w.service.clock
    ttl, limit = w.ttl_ms, w.service.settings.unpaid_limit

    def variant(n: int) -> Run:
        users, ids = w.users("n", n), w.order_ids(n)

        def op(i: int) -> None:
            now = clock()
            key = w.key(users[i])
            if int(client.zcard(key)) >= limit:
                raise RuntimeError("naive create refused a new user")
            client.zadd(key, {ids[i]: now + ttl})
            insert_one(w.row(ids[i], users[i], now, now + ttl))

        return run_ops(op, n, threads)

    return variant


def evalsha_refused(w: Workload, threads: int = 1) -> Variant:
    """One EVALSHA of the admission script that refuses (the same full users), on
    ``threads`` threads."""
    client, sha, clock = w.client, w.admit_sha, w.service.clock
    ttl, window_ms = w.ttl_ms, w.service.index.window_ms
    keys = [w.admit_keys(u) for u in w.full_users()]

    def variant(n: int) -> Run:
        ids = w.order_ids(n)

        def op(i: int) -> None:
            now = clock()
            args = admit_args(
                ids[i], expires_at_ms=now + ttl, now_ms=now, limit=1, window_ms=window_ms
            )
            user_keys = keys[i % len(keys)]
            reply = client.evalsha(sha, len(user_keys), *user_keys, *args)
            if int(reply[0]) != -1:
                raise RuntimeError("raw admission at the limit was not refused")

        return run_ops(op, n, threads)

    return variant


def raw_transition(w: Workload, kind: EventKind, threads: int = 1) -> Variant:
    """Its floor: the raw driver's ``UPDATE ... WHERE status = 'unpaid'`` and the event row,
    in one committed transaction (no Redis: the orders have no members)."""
    driver, clock = RawDriver(w.engine, w.connections(threads)), w.service.clock

    def variant(n: int) -> Run:
        ids, users = w.open_orders("r", n, members=False)
        try:
            return run_ops(lambda i: driver.transition(kind, ids[i], users[i], clock()), n, threads)
        finally:
            driver.release()

    return variant
