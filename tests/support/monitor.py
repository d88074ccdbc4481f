"""The one limit monitor: how many unpaid orders users hold, sampled in a thread while a load
runs, in SQL and (for one user) in the Redis index.

What a sample measures. One SQL statement reads the expiries of the watched users' unpaid
rows; ``t0`` is read on the monitor's clock just before it, ``t1`` just after. Per user:

* ``unpaid``: the unpaid rows, expired or not. Each holds one of the user's ``limit`` slots
  (the SQL guard is a unique index on the slots 1..limit), so no snapshot holds more.
* ``sql``: the rows expiring after ``t1``, the exact open count. Every create whose row the
  statement sees ran its guard with a clock reading before ``t1``, so at most ``limit`` of
  them expire after ``t1``.
* ``sql_after_t0``: the rows expiring after ``t0``; the rows between ``t0`` and ``t1`` are
  ones a later create could rightly ignore, so over the limit here alone is counted as a
  ``t0`` artefact, not a violation (with the slot index there should be none).

In Redis, ``ZCOUNT (now +inf`` of the user's key, ``now`` read after the statement, and
``ZCARD``: neither may pass the limit (only the admit script adds, and it drops expired
members and refuses at the limit first). A sample where any count passes the limit is a
violation, kept as a line of text.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection
from typing import NamedTuple

from sqlalchemy import Engine, select

from orders.index.nodes import RedisClient
from orders.sql.models import orders_table
from tests.support.clocks import now_ms

OC = orders_table.c
JOIN_TIMEOUT_S = 60


class Sample(NamedTuple):
    """One sample, the largest count of any watched user (0 where nothing was read)."""

    sql: int
    sql_after_t0: int
    zcount: int
    zcard: int
    unpaid: int


class LimitMonitor:
    """Samples the watched users' unpaid orders (see the module doc) from ``start()`` to
    ``stop()``, or through a ``with`` block; ``stop()`` raises what the thread raised.

    ``client``, ``key`` and ``user_id``: one user, and its key in the Redis index, sampled
    too. Else ``users`` (None: every user), in SQL only. ``clock``: the service's (the wall
    clock of worker processes, or a test's own). ``limit``: what no count may pass (also
    given to ``start`` or ``sample``; None: nothing is a violation, the maxima still count).
    """

    def __init__(
        self,
        engine: Engine,
        client: RedisClient | None = None,
        key: str | None = None,
        user_id: str | None = None,
        *,
        users: Collection[str] | None = None,
        limit: int | None = None,
        clock: Callable[[], int] = now_ms,
        pause_s: float = 0.002,
    ) -> None:
        if (client is None) != (key is None):
            raise ValueError("the Redis index is sampled with both a client and a key")
        self.engine, self.client, self.key, self.user_id = engine, client, key, user_id
        self.users = [user_id] if user_id is not None else None if users is None else list(users)
        self.limit, self.clock, self.pause_s = limit, clock, pause_s
        self.samples = 0
        self.max_sql = self.max_zcount = self.max_zcard = self.max_unpaid = 0
        self.violations: list[str] = []
        self.t0_artefacts = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self, limit: int | None = None) -> Sample:
        """Take one sample now, count it in, and return it."""
        limit = self.limit if limit is None else limit
        query = select(OC.user_id, OC.expires_at_ms).where(OC.status == "unpaid")
        if self.users is not None:
            query = query.where(OC.user_id.in_(self.users))
        with self.engine.connect() as conn:
            t0 = self.clock()
            rows = conn.execute(query).all()
            t1 = self.clock()
        unpaid = Counter(user for user, _ in rows)
        after_t0 = Counter(user for user, expires_at_ms in rows if expires_at_ms > t0)
        exact = Counter(user for user, expires_at_ms in rows if expires_at_ms > t1)
        zcount = zcard = 0
        if self.client is not None and self.key is not None:
            t2 = self.clock()
            zcount = int(self.client.zcount(self.key, f"({t2}", "+inf"))
            zcard = int(self.client.zcard(self.key))
        taken = Sample(
            sql=max(exact.values(), default=0),
            sql_after_t0=max(after_t0.values(), default=0),
            zcount=zcount,
            zcard=zcard,
            unpaid=max(unpaid.values(), default=0),
        )
        self.samples += 1
        self.max_sql = max(self.max_sql, taken.sql)
        self.max_zcount = max(self.max_zcount, zcount)
        self.max_zcard = max(self.max_zcard, zcard)
        self.max_unpaid = max(self.max_unpaid, taken.unpaid)
        if limit is not None:
            self._judge(limit, t1, taken, unpaid, after_t0, exact)
        return taken

    def _judge(
        self,
        limit: int,
        t1: int,
        taken: Sample,
        unpaid: Counter[str],
        after_t0: Counter[str],
        exact: Counter[str],
    ) -> None:
        if any(exact[user] <= limit < n for user, n in after_t0.items()):
            self.t0_artefacts += 1
        for user, n in unpaid.items():
            if n > limit or exact[user] > limit:
                self.violations.append(
                    f"t={t1}: {user} holds {exact[user]} open orders in SQL "
                    f"(after t0: {after_t0[user]}, unpaid {n})"
                )
        if taken.zcount > limit or taken.zcard > limit:
            self.violations.append(
                f"t={t1}: {self.user_id} in Redis: zcount {taken.zcount}, zcard {taken.zcard}"
            )

    def _run(self) -> None:
        try:
            while True:  # one sample at least, however soon the load ends
                self.sample()
                if self.stop_event.wait(self.pause_s):
                    break
        except BaseException as exc:
            self.error = exc

    def start(self, limit: int | None = None) -> None:
        if limit is not None:
            self.limit = limit
        self.thread.start()

    def stop(self) -> None:
        """Stop sampling (again: no harm) and raise what the thread raised, if anything."""
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(JOIN_TIMEOUT_S)
        assert not self.thread.is_alive(), "the monitor did not stop"
        if self.error is not None:
            raise self.error

    def __enter__(self) -> LimitMonitor:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
