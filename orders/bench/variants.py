"""The variants the figures compare: each, given n, prepares its data and times n ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import insert

from orders.bench.measure import (
    Run,
    Variant,
    run_ops,
)
from orders.bench.workload import Workload
from orders.errors import UnpaidOrderLimitReached
from orders.models import orders_table
from orders.records import LimitReachedInSql


def create(w: Workload, threads: int = 1) -> Variant:
    service = w.service

    def variant(n: int) -> Run:
        users = w.users("c", n)
        return run_ops(lambda i: service.create_unpaid_order(users[i]), n, threads)

    return variant


def evalsha(w: Workload, threads: int = 1) -> Variant:
    """One EVALSHA of the admission script that admits (a new user per op)."""
    client, sha, clock = w.client, w.admit_sha, w.service.clock
    s = w.service.settings
    ttl, limit, margin = s.ttl_ms, s.unpaid_limit, s.key_margin_ms

    def variant(n: int) -> Run:
        keys = [w.key(u) for u in w.users("e", n)]
        ids = w.order_ids(n)

        def op(i: int) -> None:
            now = clock()
            client.evalsha(sha, 1, keys[i], ids[i], now + ttl, now, limit, margin)

        return run_ops(op, n, threads)

    return variant


def _insert_one(w: Workload) -> Callable[[dict[str, Any]], None]:
    statement = insert(orders_table)
    engine = w.engine

    def insert_one(row: dict[str, Any]) -> None:
        with engine.connect() as conn:
            conn.execute(statement, row)
            conn.commit()

    return insert_one


def raw_insert(w: Workload, threads: int = 1) -> Variant:
    """One Core INSERT + COMMIT of a row shaped like a create's."""
    insert_one, clock, ttl = (
        _insert_one(w),
        w.service.clock,
        w.service.settings.ttl_ms,
    )

    def variant(n: int) -> Run:
        users, ids = w.users("i", n), w.order_ids(n)

        def op(i: int) -> None:
            now = clock()
            insert_one(w.row(ids[i], users[i], now, now + ttl))

        return run_ops(op, n, threads)

    return variant


def naive(w: Workload, threads: int = 1) -> Variant:
    """The original article's create: ZCARD, then ZADD from the client, then INSERT."""
    client, insert_one, clock = w.client, _insert_one(w), w.service.clock
    ttl, limit = w.service.settings.ttl_ms, w.service.settings.unpaid_limit

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


def refusal(w: Workload) -> Variant:
    """``create_unpaid_order`` refused at the limit (users holding 1 of 1)."""
    service, users = w.service, w.full_users()

    def op(i: int) -> None:
        try:
            service.create_unpaid_order(users[i % len(users)], limit=1)
        except UnpaidOrderLimitReached:
            return
        raise RuntimeError("a create at the limit was admitted")

    return lambda n: run_ops(op, n)


def evalsha_refused(w: Workload) -> Variant:
    """One EVALSHA of the admission script that refuses (the same full users)."""
    client, sha, clock = w.client, w.admit_sha, w.service.clock
    s = w.service.settings
    keys = [w.key(u) for u in w.full_users()]

    def variant(n: int) -> Run:
        ids = w.order_ids(n)

        def op(i: int) -> None:
            now = clock()
            reply = client.evalsha(
                sha, 1, keys[i % len(keys)], ids[i], now + s.ttl_ms, now, 1, s.key_margin_ms
            )
            if int(reply[0]) != -1:
                raise RuntimeError("raw admission at the limit was not refused")

        return run_ops(op, n)

    return variant


def sql_guard(w: Workload, *, refuse: bool) -> Variant:
    """The SQL guard alone: ``records.insert_guarded`` (count + insert under the user's lock)."""
    service, clock, ttl = w.service, w.service.clock, w.service.settings.ttl_ms

    def variant(n: int) -> Run:
        users = w.full_users() if refuse else w.users("g", n)
        ids = w.order_ids(n)
        limit = 1 if refuse else service.settings.unpaid_limit

        def op(i: int) -> None:
            now = clock()
            values = w.row(ids[i], users[i % len(users)], now, now + ttl)
            try:
                service.records.insert_guarded(values, limit, now)
            except LimitReachedInSql:
                if refuse:
                    return
                raise
            if refuse:
                raise RuntimeError("the SQL guard admitted an order at the limit")

        return run_ops(op, n)

    return variant
