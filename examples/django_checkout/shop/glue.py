"""orders inside Django's transaction: the glue, and the one OrderService of the process.

:func:`order_transaction` opens Django's ``transaction.atomic()`` and yields a SQLAlchemy
``Connection`` that runs on Django's own DBAPI connection, so what the service writes
(the order, its slot, its event) commits or rolls back with Django's rows. orders learns
the outcome from SQLAlchemy's transaction events on that Connection (``commit`` keeps the
Redis admission, ``rollback`` takes it back); Django has no such events, so the glue
replays Django's outcome onto the Connection once Django has finished:

* Django committed: ``conn.commit()``. SQLAlchemy sends its ``commit`` event (orders'
  Redis follow-up runs), then asks the DBAPI connection to commit: a no-op here.
* Django rolled back (an exception left the block, or its COMMIT failed):
  ``conn.rollback()``, the same way; the exception goes on.

The DBAPI connection SQLAlchemy sees is Django's, wrapped (:class:`DjangoOwned`) so that
``commit``, ``rollback`` and ``close`` do nothing: while Django's transaction is open, no
COMMIT, ROLLBACK or close of SQLAlchemy's ever reaches it (SQLAlchemy rolls back on its
first connect and when a Connection is closed inside a transaction).

Inside an outer ``atomic()`` (``ATOMIC_REQUESTS``, a caller's block) the glue's block is a
savepoint: its own exception still rolls the order back at once, but the commit only
happens with the outer block, so the follow-up waits for ``transaction.on_commit``.
Django tells nobody when an outer block rolls back: the order's row is gone, its Redis
member stays until reconcile removes it (see README.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from sqlalchemy import URL, Connection, Engine, create_engine
from sqlalchemy.pool import NullPool

from orders.bootstrap import build_service
from orders.config import Settings
from orders.service import OrderService

_LOCK = threading.Lock()
_ENGINES: dict[str, Engine] = {}
_SERVICES: dict[str, OrderService] = {}


class DjangoOwned:
    """Django's DBAPI connection as SQLAlchemy sees it: everything passes through but the
    end of the transaction and the close, which stay Django's."""

    def __init__(self, dbapi_connection: Any) -> None:
        self.dbapi_connection = dbapi_connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dbapi_connection, name)

    def commit(self) -> None:
        """Django commits."""

    def rollback(self) -> None:
        """Django rolls back."""

    def close(self) -> None:
        """Django closes."""


def database_url(using: str = DEFAULT_DB_ALIAS) -> URL:
    """The URL of Django's database ``using``, as it is now (under the test runner: the
    test database Django made)."""
    connection = connections[using]
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        return URL.create("sqlite", database=str(params["NAME"]))
    if connection.vendor == "postgresql":
        host = params.get("HOST") or None
        socket_folder = host is not None and host.startswith("/")
        return URL.create(
            "postgresql+psycopg",
            username=params.get("USER") or None,
            password=params.get("PASSWORD") or None,
            host=None if socket_folder else host,
            port=int(params["PORT"]) if params.get("PORT") else None,
            database=params["NAME"],
            query={"host": host} if socket_folder and host else {},
        )
    raise NotImplementedError(f"orders runs on SQLite and PostgreSQL, not {connection.vendor}")


def host_engine(using: str = DEFAULT_DB_ALIAS) -> Engine:
    """An engine whose one connection is Django's current one for ``using`` (made once)."""
    with _LOCK:
        engine = _ENGINES.get(using)
        if engine is None:

            def django_connection() -> DjangoOwned:
                django = connections[using]  # this thread's: Django's are per thread
                django.ensure_connection()
                return DjangoOwned(django.connection)

            options: dict[str, Any] = {}
            if connections[using].vendor == "postgresql":
                options["use_native_hstore"] = False  # no type lookup on Django's connection
            engine = create_engine(
                database_url(using),
                creator=django_connection,
                poolclass=NullPool,
                pool_reset_on_return=None,
                **options,
            )
            _ENGINES[using] = engine
        return engine


@contextmanager
def order_transaction(using: str = DEFAULT_DB_ALIAS) -> Iterator[Connection]:
    """Django's ``atomic()`` and a SQLAlchemy Connection in it, for ``connection=``."""
    outermost = not connections[using].in_atomic_block
    conn = host_engine(using).connect()
    try:
        with transaction.atomic(using=using):
            yield conn
    except BaseException:
        # Rolled back: Django's whole transaction, or the savepoint of this block.
        conn.rollback()
        conn.close()
        raise
    if outermost:
        committed(conn)
    else:
        transaction.on_commit(lambda: committed(conn), using=using)


def committed(conn: Connection) -> None:
    """Django committed: SQLAlchemy's ``commit`` event runs orders' follow-up."""
    conn.commit()
    conn.close()


def order_service(using: str = DEFAULT_DB_ALIAS) -> OrderService:
    """The process's OrderService on Django's database ``using`` (built on first use, with
    its own engine; Redis and the limit from the ``ORDERS_*`` variables)."""
    with _LOCK:
        service = _SERVICES.get(using)
        if service is None:
            url = database_url(using).render_as_string(hide_password=False)
            service = _SERVICES[using] = build_service(Settings.from_env(database_url=url))
        return service


def close_services() -> None:
    """Close every service (their pools hold connections to the database: Django's test
    runner cannot drop a PostgreSQL test database they still use)."""
    with _LOCK:
        services = list(_SERVICES.values())
        _SERVICES.clear()
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for service in services:
        service.close()
    for engine in engines:
        engine.dispose()
