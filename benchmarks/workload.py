"""The bench's workload: its namespace in the stores, its rows and keys, and cleanup."""

from __future__ import annotations

import itertools
import os
import platform
import secrets
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import redis
import sqlalchemy
from sqlalchemy import delete, func, insert, select, update

from benchmarks.loop import BenchLoop
from benchmarks.measure import (
    Run,
    Sizes,
    Variant,
    chunks,
    python_loop_ms,
)
from orders.domain import EventKind, OrderIdGenerator, OrderStatus
from orders.index.keys import glob_escape
from orders.index.nodes import RedisClient
from orders.index.unpaid import load_script
from orders.service import OrderService
from orders.sql.failures import sql_errors
from orders.sql.models import events_table, orders_table
from orders.sql.predicates import UNPAID_PREDICATE

OC = orders_table.c
UNPAID = OrderStatus.UNPAID.value
CREATED = EventKind.CREATED.value

#: "Now" of the sweep figure, and the start of the close-lag figure's shifted clock:
#: 2001-09-09, long before any real order was created.
SWEEP_NOW_MS = 1_000_000_000_000
#: How far past its latest expiry the close-lag figure checks that no foreign order is due.
FOREIGN_MARGIN_MS = 24 * 3600 * 1000


class Workload:
    """The stores, the bench's own namespace in them (users, ids, rows, keys), and the
    interleaved measuring of variants."""

    def __init__(
        self,
        service: OrderService,
        sizes: Sizes,
        *,
        step: Callable[[float], None] = lambda _units: None,
        status: Callable[[str], None] = lambda _text: None,
    ) -> None:
        self.service = service
        self.sizes = sizes
        self.engine = service.engine
        self.client: RedisClient = service.index.client
        self.step = step
        self.status = status
        self.tag = f"bench-{secrets.token_hex(4)}-"
        self.key_tag = service.index.key_prefix + self.tag
        self.notes: list[str] = []
        self._serial = itertools.count()
        self._bulk_serial = itertools.count()
        self._bulk_prefix = "B" + self.tag[6:14]
        self._new_id = OrderIdGenerator(service.clock)
        self.admit_sha: str = self.client.script_load(load_script("admit"))
        #: The time to pay of the orders the floors write themselves (the default policy's).
        self.ttl_ms = round(service.settings.default_policy.ttl_s * 1000)
        self._full_users: list[str] | None = None
        #: The async variants' event loop and service (built when the first is made).
        self.loop = BenchLoop(service.settings, service.clock)
        self._single: OrderService | None = None

    @property
    def single(self) -> OrderService:
        """The service with nothing combined (``combine_creates`` and
        ``combine_transitions`` off, the defaults before issue 45): every call by the single
        path, on the same engine, Redis client and clock (built on first use)."""
        if self._single is None:
            s = self.service
            settings = replace(s.settings, combine_creates=False, combine_transitions=False)
            self._single = OrderService(s.engine, s.index.client, settings, clock=s.clock)
        return self._single

    def connections(self, threads: int) -> int:
        """How many connections a floor on ``threads`` threads may hold: one a thread, up
        to what the service's own pool may open (its size and overflow)."""
        settings = self.service.settings
        return min(threads, settings.sql_pool_size + settings.sql_max_overflow)

    def users(self, kind: str, n: int) -> list[str]:
        """``n`` user ids never used before, all under the bench's tag."""
        batch = next(self._serial)
        return [f"{self.tag}{kind}{batch}-{i}" for i in range(n)]

    def order_ids(self, n: int) -> list[str]:
        """``n`` fresh ULIDs (26 characters), like the service's own ids."""
        return [self._new_id() for _ in range(n)]

    def bulk_ids(self, n: int) -> list[str]:
        """``n`` fresh 26-character ids, cheaper to make than ULIDs (for bulk rows)."""
        return [f"{self._bulk_prefix}{next(self._bulk_serial):017d}" for _ in range(n)]

    def key(self, user_id: str) -> str:
        return self.service.index.key(user_id)

    def admit_keys(self, user_id: str) -> list[str]:
        """``admit.lua``'s KEYS for the user: its set, its admissions hash, its own limit."""
        return self.service.index.admit_keys(user_id)

    @staticmethod
    def row(order_id: str, user_id: str, created_ms: int, expires_ms: int) -> dict[str, Any]:
        """An orders row of the shape ``create_unpaid_order`` inserts (no amount, no metadata)."""
        return {
            "id": order_id,
            "user_id": user_id,
            "status": UNPAID,
            "amount": None,
            "currency": None,
            "created_at_ms": created_ms,
            "expires_at_ms": expires_ms,
            "updated_at_ms": created_ms,
            "metadata": None,
            "remind_at_ms": None,
            "policy": None,
        }

    @staticmethod
    def minimal_row(
        order_id: str, user_id: str, created_ms: int, expires_ms: int
    ) -> dict[str, Any]:
        """The columns the raw floor writes (the others keep their defaults)."""
        return {
            "id": order_id,
            "user_id": user_id,
            "status": UNPAID,
            "created_at_ms": created_ms,
            "expires_at_ms": expires_ms,
            "updated_at_ms": created_ms,
        }

    @staticmethod
    def created_event(order_id: str, user_id: str, at_ms: int) -> dict[str, Any]:
        return {"order_id": order_id, "user_id": user_id, "kind": CREATED, "at_ms": at_ms}

    def insert_rows(self, rows: Sequence[dict[str, Any]], chunk: int = 5000) -> None:
        """Bulk rows with Core executemany, one transaction per chunk."""
        statement = insert(orders_table)
        for part in chunks(rows, chunk):
            with sql_errors(), self.engine.begin() as conn:
                conn.execute(statement, list(part))

    def cancel_rows(self, ids: Sequence[str]) -> None:
        """Set these orders cancelled directly (untimed setup; they have no members)."""
        cancel = update(orders_table).values(status="cancelled", closed_at_ms=OC.updated_at_ms)
        for part in chunks(ids, 500):
            with sql_errors(), self.engine.begin() as conn:
                conn.execute(cancel.where(OC.id.in_(list(part))))

    def delete_ids(self, ids: Sequence[str]) -> None:
        for part in chunks(ids, 500):
            with sql_errors(), self.engine.begin() as conn:
                conn.execute(delete(orders_table).where(OC.id.in_(list(part))))

    def open_orders(self, kind: str, n: int, *, members: bool) -> tuple[list[str], list[str]]:
        """``n`` open unpaid orders of ``n`` new users, inserted directly (untimed setup):
        their ids and users; with ``members``, each also gets its Redis member, as a create
        would have added."""
        now = self.service.clock()
        expires = now + self.ttl_ms
        ids = self.order_ids(n)
        users = self.users(kind, n)
        self.insert_rows([self.row(o, u, now, expires) for o, u in zip(ids, users, strict=True)])
        if members:
            self.add_members(users, ids, [expires] * n)
        return ids, users

    def add_members(self, users: Sequence[str], ids: Sequence[str], scores: Sequence[int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for user, oid, score in zip(users, ids, scores, strict=True):
            pipe.zadd(self.key(user), {oid: score})
        pipe.execute()

    def full_users(self) -> list[str]:
        """Users holding one open order each, admitted by the service with limit 1."""
        if self._full_users is None:
            users = self.users("full", min(self.sizes.ops, 1000))
            for user in users:
                self.service.create_unpaid_order(user, limit=1)
            self._full_users = users
        return self._full_users

    def foreign_unpaid_due(self, cutoff_ms: int) -> int:
        """Unpaid orders of other users due by ``cutoff_ms``: a shifted sweep would close them."""
        query = (
            select(func.count())
            .select_from(orders_table)
            .where(UNPAID_PREDICATE, OC.expires_at_ms <= cutoff_ms)
            .where(~OC.user_id.startswith(self.tag, autoescape=True))
        )
        with sql_errors(), self.engine.connect() as conn:
            return int(conn.scalar(query) or 0)

    def measure(
        self,
        label: str,
        variants: Mapping[str, Variant],
        *,
        n: int | None = None,
        reps: int | None = None,
    ) -> dict[str, list[Run]]:
        """One warm-up run of each variant, then ``reps`` rounds of A B C ..., in turn."""
        n = self.sizes.ops if n is None else n
        reps = self.sizes.reps if reps is None else reps
        self.status(f"{label}: warm-up")
        for variant in variants.values():
            variant(min(n, self.sizes.warmup))
            self.step(1)
        runs: dict[str, list[Run]] = {name: [] for name in variants}
        for rep in range(reps):
            self.status(f"{label}: repetition {rep + 1} of {reps}")
            for name, variant in variants.items():
                runs[name].append(variant(n))
                self.step(1)
        return runs

    @property
    def ops_per_variant(self) -> int:
        """Operations :meth:`measure` runs of each variant by default, warm-up included."""
        return self.sizes.reps * self.sizes.ops + min(self.sizes.ops, self.sizes.warmup)

    @property
    def sweep_reps(self) -> int:
        """Repetitions per sweep phase: each costs a fresh load of due orders."""
        return min(self.sizes.reps, 3)

    def settle(self) -> None:
        """After a bulk load or delete: fresh planner statistics, and on PostgreSQL a VACUUM,
        as a live table kept by autovacuum would have."""
        with sql_errors(), self.engine.connect() as conn:
            if self.engine.dialect.name == "postgresql":
                conn.execution_options(isolation_level="AUTOCOMMIT")
                conn.exec_driver_sql(f"VACUUM (ANALYZE) {orders_table.name}")
            else:
                conn.exec_driver_sql(f"ANALYZE {orders_table.name}")
                conn.commit()

    def delete_users(self, prefix: str) -> None:
        with sql_errors(), self.engine.begin() as conn:
            conn.execute(delete(orders_table).where(OC.user_id.startswith(prefix, autoescape=True)))

    def fill_open(self, n: int) -> str:
        """``n`` unpaid orders not due for a week (3 per user), inserted directly.

        Returns the user-id prefix of their users (see :meth:`delete_users`).
        """
        users = self.users("o", max(1, (n + 2) // 3))
        prefix = users[0].rpartition("-")[0] + "-"
        if n <= 0:
            return prefix
        now = self.service.clock()
        ids = self.bulk_ids(n)
        week = 7 * 24 * 3600 * 1000
        step = 10_000
        for start in range(0, n, step):
            end = min(n, start + step)
            self.insert_rows(
                [self.row(ids[i], users[i // 3], now, now + week + i) for i in range(start, end)]
            )
        return prefix

    def used_memory(self) -> int:
        info: dict[str, Any] = self.client.info("memory")
        return int(info["used_memory"])

    def cleanup(self) -> None:
        """Delete the bench's rows (their events go by the cascade) and its Redis keys."""
        self._full_users = None
        with sql_errors(), self.engine.begin() as conn:
            conn.execute(
                delete(orders_table).where(OC.user_id.startswith(self.tag, autoescape=True))
            )
        for part in chunks(self.bench_keys(), 1000):
            self.client.delete(*part)

    def close(self) -> None:
        """Close the async variants' service and event loop, and with them their threads
        (after each figure; the next async variant builds them again), and the combining
        service's hook threads (not its engine and client: they are the bench's own)."""
        single, self._single = self._single, None
        if single is not None:
            single.sweep.close()
            single.payments.close()
            single.admitter.confirmations.close()
        self.loop.close()

    def bench_keys(self) -> list[str]:
        """The bench users' keys: their sets, and their admissions hashes, which the
        index names after the set (``orders.index.keys.admits_key``)."""
        admits = self.service.index.admits_key(self.tag)
        hashes = admits[: admits.rindex(self.key_tag) + len(self.key_tag)]
        found: list[str] = []
        for start in (self.key_tag, hashes):
            keys = self.client.scan_iter(match=glob_escape(start) + "*", count=1000)
            found.extend(k.decode() if isinstance(k, bytes) else str(k) for k in keys)
        return found

    def left_behind(self) -> dict[str, int]:
        mine = OC.user_id.startswith(self.tag, autoescape=True)
        events_mine = events_table.c.user_id.startswith(self.tag, autoescape=True)
        with sql_errors(), self.engine.connect() as conn:
            rows = conn.scalar(select(func.count()).select_from(orders_table).where(mine))
            events = conn.scalar(select(func.count()).select_from(events_table).where(events_mine))
        return {"rows": int(rows or 0), "events": int(events or 0), "keys": len(self.bench_keys())}

    def machine(self) -> dict[str, Any]:
        server: dict[str, Any] = self.client.info("server")
        dialect = self.engine.dialect.name
        if dialect == "sqlite":
            sql_version = sqlite3.sqlite_version
        else:
            with sql_errors(), self.engine.connect() as conn:
                sql_version = str(
                    conn.exec_driver_sql(
                        "SHOW server_version" if dialect == "postgresql" else "SELECT version()"
                    ).scalar()
                )
        return {
            "nproc": os.cpu_count() or 0,
            "load_average": os.getloadavg()[0],
            "python_loop_ms": python_loop_ms(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "redis": str(server.get("redis_version", "?")),
            "sql_engine": dialect,
            "sql_version": sql_version,
            "sqlalchemy": sqlalchemy.__version__,
            "redis_py": redis.__version__,
            **self.durability(),
        }

    def durability(self) -> dict[str, Any]:
        """What a commit waits for: the server's settings (PostgreSQL) or the pragmas of the
        engine's own connection (SQLite), and whether they make a commit durable."""
        dialect = self.engine.dialect.name
        with sql_errors(), self.engine.connect() as conn:
            if dialect == "postgresql":
                names = ("fsync", "synchronous_commit", "full_page_writes")
                found = {n: str(conn.exec_driver_sql(f"SHOW {n}").scalar()) for n in names}
                durable = found["fsync"] == "on" and found["synchronous_commit"] != "off"
                durable = durable and found["full_page_writes"] == "on"
            elif dialect == "sqlite":
                mode = str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()
                level = int(conn.exec_driver_sql("PRAGMA synchronous").scalar() or 0)
                found = {"journal_mode": mode, "synchronous": _SQLITE_SYNC.get(level, str(level))}
                # FULL syncs every commit; under NORMAL a power cut may lose the last ones.
                durable = level >= 2
            else:
                return {"sql_settings": {}, "durable": None}
        return {"sql_settings": found, "durable": durable}


#: PRAGMA synchronous's levels by name.
_SQLITE_SYNC = {0: "off", 1: "normal", 2: "full", 3: "extra"}
