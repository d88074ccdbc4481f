"""The bench's state: its sizes, a service, its own share of the stores and the raw ways to
them.

Everything it writes carries its tag ``bench-<random>-``: user ids, order ids, and so the
Redis keys the documented layout names after a user (``<key prefix><user>`` and its
``<key prefix>[admits]{<key prefix><user>}`` companions). Those are deleted at the end.
The raw statements name the documented tables (``oes_orders``, ``oes_order_events``) and
run on the DBAPI driver under the engine (sqlite3, psycopg): no SQLAlchemy per operation.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import Engine, text

from orders import OrderService, Settings
from orders.bench.measure import Run, compared, side_by_side

#: KEYS[1] the user's set; ARGV limit, score, member. The least an atomic check-and-add
#: costs: -1 at the limit, else the member is added.
CHECK_AND_ADD = """
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return -1 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
return 1
"""


@dataclass(frozen=True, slots=True)
class Sizes:
    """Calls per run (a tenth of them more first, unmeasured), runs side by side, the
    sweep's due orders, the close lag's rate and length."""

    ops: int = 1000
    reps: int = 5
    sweep_due: int = 10_000
    lag_rate_s: float = 500.0
    lag_s: float = 10.0


QUICK = Sizes(ops=100, reps=3, sweep_due=500, lag_rate_s=200.0, lag_s=1.5)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Bench:
    """What the figures share: the stores and settings, a service on them, the sizes, the
    notes, and the bench's tag."""

    def __init__(self, engine: Engine, client: redis.Redis, settings: Settings, sizes: Sizes):
        self.engine, self.client, self.settings, self.sizes = engine, client, settings, sizes
        self.service = OrderService(engine, client, settings)
        self.notes: list[str] = []
        self.ttl_ms = round(settings.default_policy.ttl_s * 1000)
        #: What one create took, as the create figure measured it (the close lag's lead).
        self.create_ms = 5.0
        self.tag = f"bench-{secrets.token_hex(4)}-"
        self.script = client.register_script(CHECK_AND_ADD)
        self._serial = itertools.count()
        mark = "?" if engine.dialect.paramstyle == "qmark" else "%s"
        # S608: built from the schema's names and the driver's placeholder, never from input.
        self.insert_order = (
            "INSERT INTO oes_orders (id, user_id, status, created_at_ms, expires_at_ms, "  # noqa: S608
            f"updated_at_ms) VALUES ({mark}, {mark}, 'unpaid', {mark}, {mark}, {mark})"
        )
        self.insert_event = (
            "INSERT INTO oes_order_events (order_id, user_id, kind, at_ms) "  # noqa: S608
            f"VALUES ({mark}, {mark}, {mark}, {mark})"
        )
        self.pay = (
            f"UPDATE oes_orders SET status = 'paid', paid_at_ms = {mark}, updated_at_ms = {mark} "  # noqa: S608
            f"WHERE id = {mark} AND status = 'unpaid'"
        )

    def side_by_side(self, **variants: Callable[[int], Run]) -> dict[str, Any]:
        z = self.sizes
        return compared(side_by_side(variants, z.ops, z.reps, z.ops // 10))

    def users(self, kind: str, n: int) -> list[str]:
        """``n`` user (and order) ids never used before, under the bench's tag."""
        batch = next(self._serial)
        return [f"{self.tag}{kind}{batch}-{i}" for i in range(n)]

    def key(self, user_id: str) -> str:
        return self.settings.key_prefix + user_id

    @contextlib.contextmanager
    def raw(self) -> Iterator[tuple[Any, Any]]:
        """A DBAPI connection of the engine's pool (its connect-time settings applied) and
        a cursor."""
        conn = self.engine.raw_connection()
        try:
            with contextlib.closing(conn.cursor()) as cursor:
                yield conn, cursor
        finally:
            conn.close()

    def open_orders(self, kind: str, n: int, now_ms: int, expires_ms: int) -> list[str]:
        """``n`` unpaid orders of new users, inserted raw with their Redis members (untimed
        setup); their ids, which are their users' too."""
        ids = self.users(kind, n)
        with self.raw() as (conn, cursor):
            cursor.executemany(
                self.insert_order, [(i, i, now_ms - 60_000, expires_ms, now_ms) for i in ids]
            )
            conn.commit()
        pipe = self.client.pipeline(transaction=False)
        for order_id in ids:
            pipe.zadd(self.key(order_id), {order_id: expires_ms})
        pipe.execute()
        return ids

    def count(self, where: str, table: str = "oes_orders", **params: Any) -> int:
        """``SELECT count(*) FROM <table> WHERE ...``, ``:tag`` bound to the tag's LIKE."""
        with self.engine.connect() as conn:
            query = text(f"SELECT count(*) FROM {table} WHERE {where}")  # noqa: S608
            return int(conn.scalar(query, {"tag": self.tag + "%", **params}) or 0)

    def foreign_unpaid_due(self, by_ms: int) -> int:
        """Unpaid orders of other users due by ``by_ms``: a sweep then would close them."""
        where = "status = 'unpaid' AND expires_at_ms <= :t AND user_id NOT LIKE :tag"
        return self.count(where, t=by_ms)

    def keys(self) -> list[bytes]:
        """The bench's keys: its users' sets, their companions, and the close-lag
        scheduler's own prefix (which starts with the tag)."""
        prefix = self.settings.key_prefix
        found: list[bytes] = []
        for pattern in (f"{prefix}{self.tag}*", f"{prefix}\\[*\\]{{{prefix}{self.tag}*"):
            found += self.client.scan_iter(match=pattern, count=1000)
        return found

    def cleanup(self) -> None:
        """Delete the bench's rows (their events go by the cascade) and its keys."""
        with self.engine.begin() as conn:
            conn.execute(
                text("DELETE FROM oes_orders WHERE user_id LIKE :tag"), {"tag": self.tag + "%"}
            )
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys():
            pipe.delete(key)
        pipe.execute()

    def left_behind(self) -> dict[str, int]:
        mine = "user_id LIKE :tag"
        events = self.count(mine, "oes_order_events")
        return {"rows": self.count(mine), "events": events, "keys": len(self.keys())}
