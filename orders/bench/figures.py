"""The figures: each use case beside the naive way and the raw floor, and the sweep (the
close lag is :mod:`orders.bench.lag`). Each returns its part of the report, or None when
skipped (a note says why).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import Any

from orders import UnpaidOrderLimitReached
from orders.bench.lag import close_lag
from orders.bench.measure import Run, counting_statements, ns, spread, timed
from orders.bench.stores import Bench, now_ms

#: "Now" of the sweep figure (2001-09-09): only the bench's own orders are due by then.
SWEEP_NOW_MS = 1_000_000_000_000


def create(b: Bench) -> dict[str, Any]:
    ttl, limit = b.ttl_ms, b.settings.unpaid_limit

    def service(n: int) -> Run:
        users = b.users("c", n)
        return timed(lambda i: b.service.create_unpaid_order(users[i]), n)

    def naive(n: int) -> Run:  # ZCARD, ZADD from the client, INSERT + COMMIT
        users = b.users("n", n)
        with b.raw() as (conn, cursor):

            def op(i: int) -> None:
                now, key = now_ms(), b.key(users[i])
                if b.client.zcard(key) >= limit:
                    raise RuntimeError("the naive create refused a new user")
                b.client.zadd(key, {users[i]: now + ttl})
                cursor.execute(b.insert_order, (users[i], users[i], now, now + ttl, now))
                conn.commit()

            return timed(op, n)

    def floor(n: int) -> Run:  # one EVALSHA, INSERT order and event + COMMIT
        users = b.users("f", n)
        with b.raw() as (conn, cursor):

            def op(i: int) -> None:
                now, user = now_ms(), users[i]
                if b.script(keys=[b.key(user)], args=[limit, now + ttl, user]) != 1:
                    raise RuntimeError("the floor's script refused a new user")
                cursor.execute(b.insert_order, (user, user, now, now + ttl, now))
                cursor.execute(b.insert_event, (user, user, "created", now))
                conn.commit()

            return timed(op, n)

    fig = b.side_by_side(create=service, naive=naive, floor=floor)
    b.create_ms = 1000 / fig["variants"]["create"]["ops_s"]["median"]
    return fig


def refusal(b: Bench) -> dict[str, Any]:
    """Users holding one order each, refused at ``limit=1``."""
    users = b.users("r", min(b.sizes.ops, 100))
    for user in users:
        b.service.create_unpaid_order(user, limit=1)
    totals = {"refusals": 0, "sql_statements": 0}

    def service(n: int) -> Run:
        def op(i: int) -> None:
            with suppress(UnpaidOrderLimitReached):
                b.service.create_unpaid_order(users[i % len(users)], limit=1)
                raise RuntimeError("a create at the limit was admitted")

        totals["refusals"] += n
        with counting_statements(b.engine, totals):
            return timed(op, n)

    def naive(n: int) -> Run:  # one ZCARD
        def op(i: int) -> None:
            if b.client.zcard(b.key(users[i % len(users)])) < 1:
                raise RuntimeError("the naive check admitted a full user")

        return timed(op, n)

    def floor(n: int) -> Run:  # one EVALSHA that refuses
        ids = b.users("x", n)

        def op(i: int) -> None:
            key = b.key(users[i % len(users)])
            if b.script(keys=[key], args=[1, now_ms() + b.ttl_ms, ids[i]]) != -1:
                raise RuntimeError("the floor's script admitted a full user")

        return timed(op, n)

    return b.side_by_side(refusal=service, naive=naive, floor=floor) | totals


def mark_paid(b: Bench) -> dict[str, Any]:
    ttl = b.ttl_ms

    def service(n: int) -> Run:
        ids = b.open_orders("p", n, now_ms(), now_ms() + ttl)
        return timed(lambda i: b.service.mark_paid(ids[i]), n)

    def floor(n: int) -> Run:  # UPDATE ... WHERE status = 'unpaid', INSERT event + COMMIT
        ids = b.open_orders("q", n, now_ms(), now_ms() + ttl)
        with b.raw() as (conn, cursor):

            def op(i: int) -> None:
                now = now_ms()
                cursor.execute(b.pay, (now, now, ids[i]))
                if cursor.rowcount != 1:
                    raise RuntimeError("the raw payment found no unpaid order")
                cursor.execute(b.insert_event, (ids[i], ids[i], "paid", now))
                conn.commit()

            return timed(op, n)

    return b.side_by_side(mark_paid=service, floor=floor)


def sweep(b: Bench) -> dict[str, Any] | None:
    """``sweep_expired`` at a "now" of 2001 on due orders inserted raw, one load a rep."""
    due = b.sizes.sweep_due
    if b.foreign_unpaid_due(SWEEP_NOW_MS):
        b.notes.append("sweep skipped: the database holds other users' orders due in 2001")
        return None
    rates = []
    for _ in range(min(3, b.sizes.reps)):
        b.open_orders("d", due, SWEEP_NOW_MS - 120_000, SWEEP_NOW_MS - 60_000)
        started = ns()
        closed = b.service.sweep_expired(now_ms=SWEEP_NOW_MS).closed
        rates.append(closed * 1e9 / (ns() - started))
        if closed != due:
            b.notes.append(f"sweep closed {closed} of {due} due orders (another sweeper?)")
    return {"due": due, "batch_size": b.settings.sweep_batch_size, "closes_s": spread(rates)}


FIGURES: dict[str, Callable[[Bench], dict[str, Any] | None]] = {
    "create": create,
    "refusal": refusal,
    "mark_paid": mark_paid,
    "sweep": sweep,
    "close_lag": close_lag,
}
