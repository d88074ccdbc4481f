"""The error contract, as one table: every public function and every ``orders`` command,
against each store failure and each malformed setting.

README: "Every error is an ``orders.OrdersError``; Redis and SQLAlchemy exceptions never
reach the caller" and "errors print one line on stderr and exit 2-8". Each function gets
the exact ``OrdersError`` subclass (or success, where the README promises one: a payment
with Redis down commits); each command gets its exit status and exactly one stderr line.

The tables are checked for completeness against what the package exposes (``orders.__all__``,
``OrderService``'s and ``Operations``' public methods, ``orders.events.admin``,
``EventConsumer``, ``orders.aio``'s ``__all__`` and ``AsyncOrderService``'s public
methods, the click group walked to its leaves, ``Settings``' fields): a new public
function, command or setting without a row fails here. Adding one is one line.

The asyncio API (``orders.aio``) has no table of its own: its rows are the synchronous
ones, awaited on a checked event loop (``tests.support.aio``), with the same outcome.
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import Engine

import orders
import orders.aio
from orders import ExpiryPolicy, InvalidInput, SchemaNotReady, StoreUnavailable
from orders.aio import AsyncOrderService
from orders.bootstrap import build_engine, build_redis
from orders.cli import main
from orders.config import Settings
from orders.errors import UnknownResource, WaitingEntryNotFound
from orders.events import admin as event_admin
from orders.events.consumer import EventConsumer
from orders.operations import Operations
from orders.service import OrderService
from tests.support.aio import new_async_service, run_checked
from tests.support.postgres import PostgresTarget
from tests.support.processes import child_env, run_orders
from tests.support.redis_server import RedisServer

#: The contract holds on one Redis server and on a Redis Cluster alike.
# On the 7.x (and a cluster) only: which error a failure becomes is decided in Python,
# the same on every server; the scripts' own behaviour is run on every server by
# test_create, test_transitions, test_sweep, test_reconcile and test_index_keys.
pytestmark = [pytest.mark.cluster_too]

#: Every Redis call gives up this fast (one retry): a dead Redis costs well under a second.
SOCKET_TIMEOUT_S = "0.2"
PREFIX = "UnpaidOrder-"
ACL_USER, ACL_PASSWORD = "contract-noperm", "contract-" + uuid.uuid4().hex
#: Given to every service and command, so that erase_user's rows reach the stores.
ERASURE_KEY = "contract-erasure-key"
#: An outcome: success, or exactly this exception type.
OK = None
Outcome = type[BaseException] | None

# --- the stores and their failures ------------------------------------------------------


@dataclass
class Stores:
    """One engine's worth of databases, and a Redis server with persistence (so no startup
    warning muddies stderr), for the whole module."""

    engine_name: str
    healthy_db: str
    empty_db: str
    unreachable_db: str
    redis_url: str
    closed_port: int
    new_empty_db: Callable[[], str]
    admin: redis.Redis = field(repr=False)


@pytest.fixture(scope="module")
def closed_port() -> Iterator[int]:
    """A loopback TCP port that is bound (so nobody else takes it) but never listens:
    connecting to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def contract_redis(redis_binary: Path | None) -> Iterator[RedisServer]:
    folder = Path(tempfile.mkdtemp(prefix="orders-contract-", dir="/tmp"))
    server = RedisServer(folder, "--appendonly", "yes", binary=redis_binary).start()
    try:
        with redis.Redis.from_url(server.url) as admin:
            # A user that may log in and do nothing: every command answers NOPERM.
            admin.acl_setuser(ACL_USER, enabled=True, passwords=[f"+{ACL_PASSWORD}"])
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stores(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    closed_port: int,
    contract_redis: RedisServer,
) -> Iterator[Stores]:
    admin = redis.Redis.from_url(contract_redis.url)
    common = {"redis_url": contract_redis.url, "closed_port": closed_port, "admin": admin}
    try:
        if request.param == "sqlite":
            folder = tmp_path_factory.mktemp("contract")
            shutil.copyfile(request.getfixturevalue("sqlite_template"), folder / "orders.db")
            empties = iter(range(1_000_000))
            yield Stores(
                "sqlite",
                healthy_db=f"sqlite:///{folder / 'orders.db'}",
                empty_db=f"sqlite:///{folder / 'empty.db'}",
                unreachable_db=f"sqlite:///{folder / 'no-such-folder' / 'orders.db'}",
                new_empty_db=lambda: f"sqlite:///{folder / f'empty-{next(empties)}.db'}",
                **common,
            )
            return
        target: PostgresTarget
        target, template = request.getfixturevalue("postgres_template")
        made = [target.new_database(template), target.new_database()]

        def new_empty_db() -> str:
            made.append(target.new_database())
            return target.url(made[-1])

        try:
            yield Stores(
                "postgresql",
                healthy_db=target.url(made[0]),
                empty_db=target.url(made[1]),
                unreachable_db=f"postgresql+psycopg://orders@127.0.0.1:{closed_port}/orders",
                new_empty_db=new_empty_db,
                **common,
            )
        finally:
            for name in made:
                target.drop_database(name)
    finally:
        admin.close()


@dataclass(frozen=True)
class Failure:
    """Which database and Redis the code under test gets; ``spoil`` breaks the user's key."""

    database: Callable[[Stores], str] = lambda s: s.healthy_db
    redis: Callable[[Stores], str] = lambda s: s.redis_url
    spoil: Callable[[Stores, str], None] = lambda s, user: None


def wrong_type(stores: Stores, user: str) -> None:
    stores.admin.delete(PREFIX + user)
    stores.admin.set(PREFIX + user, "not a sorted set")


FAILURES = {
    "redis_refused": Failure(redis=lambda s: f"redis://127.0.0.1:{s.closed_port}/0"),
    "redis_no_socket": Failure(redis=lambda s: "unix:///nonexistent-orders-dir/redis.sock"),
    "redis_wrong_type": Failure(spoil=wrong_type),
    "redis_noperm": Failure(
        redis=lambda s: f"{s.redis_url}?username={ACL_USER}&password={ACL_PASSWORD}"
    ),
    "sql_unreachable": Failure(database=lambda s: s.unreachable_db),
    "sql_no_schema": Failure(database=lambda s: s.empty_db),
}
REDIS_DOWN = ("redis_refused", "redis_no_socket", "redis_noperm")


def expectations(default: Any, sql: Any, schema: Any, **per_failure: Any) -> dict[str, Any]:
    """Outcome by failure: ``default`` for Redis failures, then the SQL ones, then overrides."""
    table = dict.fromkeys(FAILURES, default)
    table |= {"sql_unreachable": sql, "sql_no_schema": schema}
    return table | per_failure


# --- the functions ------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a row's call needs: ``api`` is the ``orders`` module, an OrderService,
    ``orders.aio`` or an AsyncOrderService; ``settings`` names the stores under test."""

    api: Any
    user: str
    order_id: str
    settings: Settings
    #: For the operator rows (event_admin, EventConsumer): synchronous surfaces only.
    engine: Engine | None = None
    consumer: EventConsumer | None = None


@dataclass(frozen=True)
class Row:
    call: Callable[[Ctx], object]
    #: On Redis failures (refused, no socket, NOPERM); ``wrong_type`` defaults to the same.
    redis: Outcome = OK
    wrong_type: Outcome | str = "same"
    sql: Outcome = StoreUnavailable
    schema: Outcome = SchemaNotReady

    def outcomes(self) -> dict[str, Outcome]:
        wrong = self.redis if self.wrong_type == "same" else self.wrong_type
        assert not isinstance(wrong, str)
        return expectations(self.redis, self.sql, self.schema, redis_wrong_type=wrong)


#: The use cases: module-level functions of ``orders`` and methods of OrderService alike.
USE_CASES: dict[str, Row] = {
    "create_unpaid_order": Row(lambda c: c.api.create_unpaid_order(c.user), StoreUnavailable),
    "mark_paid": Row(lambda c: c.api.mark_paid(c.order_id, payment_ref="psp-1")),
    "cancel_order": Row(lambda c: c.api.cancel_order(c.order_id, reason="test")),
    "extend_order": Row(lambda c: c.api.extend_order(c.order_id, 60)),
    # Each order as cancel_order / extend_order: SQL decides, Redis follows or is logged.
    "get_order": Row(lambda c: c.api.get_order(c.order_id)),
    "list_unpaid": Row(lambda c: c.api.list_unpaid(c.user)),
    "iter_events": Row(lambda c: c.api.iter_events(limit=5)),
    "sweep_expired": Row(lambda c: c.api.sweep_expired(max_batches=1)),
    # A key of another type under the prefix is foreign data: skipped and counted (README).
    "reconcile": Row(lambda c: c.api.reconcile(user_id=c.user), StoreUnavailable, OK),
    "refused_payments": Row(lambda c: c.api.refused_payments(limit=5)),
    # No payment of that order was refused: InvalidInput, unless SQL fails first.
    "mark_refund_handled": Row(
        lambda c: c.api.mark_refund_handled(c.order_id, "psp-1"), InvalidInput
    ),
    # SQL first, then the Redis copy, whose failure is logged (reconcile writes it).
    "set_user_limit": Row(lambda c: c.api.set_user_limit(c.user, 2)),
    "clear_user_limit": Row(lambda c: c.api.clear_user_limit(c.user)),
    "user_limit": Row(lambda c: c.api.user_limit(c.user)),
    "user_limit_history": Row(lambda c: c.api.user_limit_history(c.user)),
    # SQL is the record; the Redis index's copy of the capacity follows (its failure logged).
    "set_capacity": Row(lambda c: c.api.set_capacity(f"r:{c.user}", 3, per_user=1)),
    # No resource of that id: UnknownResource, unless SQL fails first.
    "resource": Row(lambda c: c.api.resource(f"r:{c.user}"), UnknownResource),
    "resources": Row(lambda c: c.api.resources(limit=5)),
    # SQL is the record; the Redis index's copy of the capacity follows (its failure logged).
    "set_units": Row(lambda c: c.api.set_units(f"u:{c.user}", ["A-1", "A-2"])),
    # No resource of that id: UnknownResource, unless SQL fails first.
    "units": Row(lambda c: c.api.units(f"r:{c.user}"), UnknownResource),
    # No resource or entry of that id: UnknownResource / WaitingEntryNotFound, unless SQL
    # fails first (the serve, which would go to Redis, comes after the entry's insert).
    "wait_for": Row(lambda c: c.api.wait_for(c.user, f"r:{c.user}"), UnknownResource),
    "waiting": Row(lambda c: c.api.waiting(f"r:{c.user}"), UnknownResource),
    "waiting_entry": Row(lambda c: c.api.waiting_entry(2**62), WaitingEntryNotFound),
    "leave_waiting": Row(lambda c: c.api.leave_waiting(2**62), WaitingEntryNotFound),
    "count_due": Row(lambda c: c.api.count_due()),
    "earliest_unpaid_expiry_ms": Row(lambda c: c.api.earliest_unpaid_expiry_ms()),
    "earliest_reminder_ms": Row(lambda c: c.api.earliest_reminder_ms()),
    # SQL is done first; the user's Redis keys then go, and a Redis failure there is raised
    # (run it again to finish). DEL takes a key of any type.
    "erase_user": Row(lambda c: c.api.erase_user(c.user), StoreUnavailable, OK),
    # Builds the default service: connects to SQL (schema check), not yet to Redis.
    "default_service": Row(lambda c: c.api.default_service()),
}
#: The operator's actions over many orders (``service.operations``): ``api`` is the service.
OPERATIONS: dict[str, Row] = {
    "cancel_matching": Row(
        lambda c: c.api.operations.cancel_matching(user_id=c.user, reason="test")
    ),
    "extend_matching": Row(lambda c: c.api.operations.extend_matching(60, user_id=c.user)),
    # SQL only; paused and resumed at once, so no pause stays open in the shared database
    # (the resume's rescore with Redis failing is logged, left to reconcile).
    "pause": Row(lambda c: (c.api.operations.pause("contract"), c.api.operations.resume())),
    "resume": Row(lambda c: c.api.operations.resume(), InvalidInput),  # nothing is paused
    "current_pause": Row(lambda c: c.api.operations.current_pause()),
    "recent_pauses": Row(lambda c: c.api.operations.recent_pauses()),
    "prune": Row(lambda c: c.api.operations.prune(3650 * 86_400, dry_run=True)),  # SQL only
}
#: Public names that are not use cases: wiring, registration, pure arithmetic.
NOT_USE_CASES = {
    "configure",  # binds the module functions to a service; no I/O
    "close",  # releases connections
    "aclose",  # likewise, awaited
    "now_ms",  # reads the clock
    "on_closed",  # registers a handler
    "on_payment_refused",  # registers a handler
    "set_pre_close_check",  # registers a hook
    "set_late_payment_check",  # registers a hook
    "set_archive_hook",  # registers a hook
    "lag_statements",  # builds two SELECTs, runs nothing
    "backoff_ms",  # arithmetic
}
#: Refusals the operator API gives on a healthy database (no such consumer): InvalidInput.
EVENT_ADMIN: dict[str, Row] = {
    "list_consumers": Row(lambda c: event_admin.list_consumers(c.engine)),
    "list_parked": Row(lambda c: event_admin.list_parked(c.engine)),
    "parked_counts": Row(lambda c: event_admin.parked_counts(c.engine)),
    "act_on_parked": Row(
        lambda c: event_admin.act_on_parked(
            c.engine, event_admin.ParkedAction.REQUEUE, "contract", 1
        ),
        InvalidInput,
    ),
}
CONSUMER: dict[str, Row] = {
    "run_once": Row(lambda c: c.consumer.run_once(limit=5)),
    "position": Row(lambda c: c.consumer.position()),
    "register": Row(lambda c: c.consumer.register()),
    "pending_retries": Row(lambda c: c.consumer.pending_retries()),
}


def public_functions(module: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value) and value.__module__ == module.__name__
        if not name.startswith("_")
    }


def public_methods(cls: type) -> set[str]:
    return {
        name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")
    }


Surfaces = dict[str, tuple[set[str], dict[str, Row]]]
SURFACES: Surfaces = {
    "orders": (
        {n for n in orders.__all__ if inspect.isfunction(getattr(orders, n))},
        USE_CASES,
    ),
    "OrderService": (public_methods(OrderService), USE_CASES),
    "Operations": (public_methods(Operations), OPERATIONS),
    "event_admin": (public_functions(event_admin), EVENT_ADMIN),
    "EventConsumer": (public_methods(EventConsumer), CONSUMER),
}


async def build_and_close(c: Ctx) -> None:
    """``orders.aio.build_async_service`` as a host's start-up calls it (closed again)."""
    service = await c.api.build_async_service(c.settings)
    await service.aclose()


#: orders.aio's rows: the synchronous table's (on orders.aio and AsyncOrderService a row's
#: call returns a coroutine, which is awaited), since the asyncio API must keep the
#: synchronous API's errors. Only its own names are added: build_async_service is
#: default_service given its Settings, and core builds the synchronous service the
#: methods run on, touching no store on one server (the first call connects).
AIO_USE_CASES: dict[str, Row] = USE_CASES | {
    "build_async_service": replace(USE_CASES["default_service"], call=build_and_close),
    "core": Row(lambda c: c.api.core(), sql=OK, schema=OK),
}
AIO_SURFACES: Surfaces = {
    # Every callable but the class: the module functions need not stay plain functions.
    "orders.aio": (
        {
            n
            for n in orders.aio.__all__
            if callable(getattr(orders.aio, n)) and not isinstance(getattr(orders.aio, n), type)
        },
        AIO_USE_CASES,
    ),
    "AsyncOrderService": (public_methods(AsyncOrderService), AIO_USE_CASES),
}


@pytest.mark.parametrize("surface", SURFACES | AIO_SURFACES)
def test_every_public_function_has_a_row(surface: str) -> None:
    exposed, rows = (SURFACES | AIO_SURFACES)[surface]
    assert exposed - NOT_USE_CASES - set(rows) == set(), "add a row to the table"
    assert exposed & set(rows), "nothing of it is run: is the surface found?"


API_CASES = [
    pytest.param(surface, name, failure, id=f"{surface}.{name}-{failure}")
    for surface, (exposed, rows) in SURFACES.items()
    for name in sorted(exposed & set(rows))
    for failure in FAILURES
]


@pytest.fixture
def module_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The module functions' default service is rebuilt from ORDERS_* for each test."""
    orders.configure(None)
    yield monkeypatch
    built = None
    with contextlib.suppress(orders.OrdersError):  # the one the test built, or none to build
        built = orders.default_service()
    orders.configure(None)
    if built is not None:
        built.close()


def healthy_orders(stores: Stores, count: int = 1) -> list[tuple[str, str]]:
    """Fresh users with one open order each (made on the healthy stores), one per row."""
    settings = Settings(database_url=stores.healthy_db, redis_url=stores.redis_url)
    service = OrderService(build_engine(settings), build_redis(settings), settings)
    try:
        users = [f"contract-{uuid.uuid4().hex[:12]}" for _ in range(count)]
        return [(user, service.create_unpaid_order(user, ttl_s=600).id) for user in users]
    finally:
        service.close()


def healthy_order(stores: Stores) -> tuple[str, str]:
    return healthy_orders(stores)[0]


def failing_settings(stores: Stores, spec: Failure, env: pytest.MonkeyPatch) -> Settings:
    """The Settings of the stores ``spec`` gives, and the same as ``ORDERS_*`` (from which
    the module functions build their default service)."""
    settings = Settings(
        database_url=spec.database(stores),
        redis_url=spec.redis(stores),
        redis_socket_timeout_s=float(SOCKET_TIMEOUT_S),
        erasure_key=ERASURE_KEY,
    )
    env.setenv("ORDERS_ERASURE_KEY", ERASURE_KEY)
    env.setenv("ORDERS_DATABASE_URL", settings.database_url.reveal())  # type: ignore[union-attr]
    env.setenv("ORDERS_REDIS_URL", settings.redis_url.reveal())  # type: ignore[union-attr]
    env.setenv("ORDERS_REDIS_SOCKET_TIMEOUT_S", SOCKET_TIMEOUT_S)
    return settings


def outcome_of(call: Callable[[], object]) -> Outcome:
    try:
        call()
    except BaseException as error:  # the point is to see whatever leaks, SystemExit too
        return type(error)
    return OK


def name_of(outcome: Outcome) -> str:
    return "success" if outcome is None else f"{outcome.__module__}.{outcome.__qualname__}"


@pytest.mark.rotate("stores")
@pytest.mark.parametrize(("surface", "name", "failure"), API_CASES)
def test_public_function_raises_the_promised_error_on_store_failure(
    stores: Stores, module_env: pytest.MonkeyPatch, surface: str, name: str, failure: str
) -> None:
    spec = FAILURES[failure]
    user, order_id = healthy_order(stores)
    spec.spoil(stores, user)
    settings = failing_settings(stores, spec, module_env)
    service = OrderService(build_engine(settings), build_redis(settings), settings)
    try:
        ctx = Ctx(
            api=orders if surface == "orders" else service,
            user=user,
            order_id=order_id,
            settings=settings,
            engine=service.engine,
            consumer=EventConsumer(service.engine, "contract", lambda event: None),
        )
        row = SURFACES[surface][1][name]
        got = outcome_of(lambda: row.call(ctx))
    finally:
        service.close()
    assert name_of(got) == name_of(row.outcomes()[failure])


# --- the asyncio API --------------------------------------------------------------------------


async def awaited_outcome(call: Callable[[], object]) -> Outcome:
    """:func:`outcome_of` for a call that returns an awaitable, awaited."""
    try:
        pending = call()
        assert inspect.isawaitable(pending), f"{pending!r} is not awaitable"
        await pending
    except BaseException as error:  # whatever leaks, CancelledError too
        return type(error)
    return OK


async def close_default() -> None:
    """Close the default service the module functions built from ``ORDERS_*``. Where their
    builds failed (a SQL failure), this one fails alike: there is nothing to close."""
    try:
        built = await orders.aio.default_service()
    except (SchemaNotReady, StoreUnavailable):
        return
    finally:
        orders.aio.configure(None)
    await built.aclose()


#: The calls that build what a service's other calls then share: each test runs them first.
BUILDS = ("default_service", "core")


async def outcomes_on(api: Any, rows: dict[str, Row], ctxs: dict[str, Ctx]) -> dict[str, Outcome]:
    """Each row's outcome on ``api``, awaited in turn, the builds first."""
    got: dict[str, Outcome] = {}
    for name in sorted(ctxs, key=lambda name: (name not in BUILDS, name)):
        got[name] = await awaited_outcome(partial(rows[name].call, replace(ctxs[name], api=api)))
    return got


async def aio_outcomes(
    surface: str, rows: dict[str, Row], ctxs: dict[str, Ctx], settings: Settings
) -> dict[str, Outcome]:
    """The rows' outcomes on one service, as a host's calls are while a store is broken: the
    default service the module functions build from ``ORDERS_*`` on first use
    (``orders.aio``), or an AsyncOrderService built as a host builds it (its AsyncEngine and
    redis.asyncio client)."""
    if surface == "orders.aio":
        orders.aio.configure(None)
        try:
            return await outcomes_on(orders.aio, rows, ctxs)
        finally:
            await close_default()
    service = await new_async_service(settings)
    try:
        return await outcomes_on(service, rows, ctxs)
    finally:
        await service.aclose()


#: One test per surface and failure, its rows on one service and loop: a service of its own
#: per row, as the synchronous rows have, took 3.5 times the CPU (measured 2026-11-26).
AIO_CASES = [
    pytest.param(surface, failure, id=f"{surface}-{failure}")
    for surface in AIO_SURFACES
    for failure in FAILURES
]


@pytest.mark.parametrize(("surface", "failure"), AIO_CASES)
def test_asyncio_function_raises_the_error_its_synchronous_row_promises(
    stores: Stores, monkeypatch: pytest.MonkeyPatch, surface: str, failure: str
) -> None:
    exposed, rows = AIO_SURFACES[surface]
    names = sorted(exposed & set(rows))
    spec = FAILURES[failure]
    made = healthy_orders(stores, len(names))
    for user, _ in made:
        spec.spoil(stores, user)
    settings = failing_settings(stores, spec, monkeypatch)
    ctxs = {
        name: Ctx(None, user, order_id, settings)
        for name, (user, order_id) in zip(names, made, strict=True)
    }
    got = run_checked(aio_outcomes(surface, rows, ctxs, settings))
    assert {name: name_of(outcome) for name, outcome in got.items()} == {
        name: name_of(rows[name].outcomes()[failure]) for name in names
    }


# --- the commands ---------------------------------------------------------------------------


def walk(group: click.Group, ctx: click.Context, prefix: str = "") -> Iterator[str]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        if isinstance(command, click.Group):
            yield from walk(command, ctx, f"{prefix}{name} ")
        else:
            yield prefix + name


ALL_COMMANDS = sorted(walk(main, click.Context(main)))
#: Not run against store failures, because they do not return:
SKIPPED = {
    # with Redis down it keeps sweeping SQL, as promised, until a signal; with SQL down it
    # exits 8 at once (run below)
    "scheduler": (*REDIS_DOWN, "redis_wrong_type"),
    # likewise: with Redis down the page shows Redis's error beside the SQL figures
    "dashboard": (*REDIS_DOWN, "redis_wrong_type"),
    # always the embedded stores in a temporary folder, never the configured ones, and
    # it runs about 10 s: no store failure of ours reaches it
    "demo": tuple(FAILURES),
}


@dataclass(frozen=True)
class Cmd:
    args: tuple[str, ...]
    exits: dict[str, int]
    #: Changes the database (run on a fresh empty one, so the shared one stays empty).
    migrates: bool = False


def cmd(*args: str, redis: int = 0, sql: int = 8, schema: int = 8, **per: int) -> Cmd:
    migrates = bool(per.pop("migrates", False))
    return Cmd(args, expectations(redis, sql, schema, **per), migrates)


COMMANDS: dict[str, Cmd] = {
    "create": cmd("create", "{user}", redis=8),
    "pay": cmd("pay", "{order}", "--ref", "psp-1"),
    "cancel": cmd("cancel", "{order}"),
    "extend": cmd("extend", "{order}", "60"),
    "show": cmd("show", "{order}"),
    "user": cmd("user", "{user}"),
    "sweep": cmd("sweep", "--max-batches", "1"),
    "stats": cmd("stats"),
    "reconcile": cmd("reconcile", "--user", "{user}", redis=8, redis_wrong_type=0),
    "db upgrade": cmd("db", "upgrade", schema=0, migrates=True),
    "db current": cmd("db", "current", schema=0),
    # Only ORDERS_HOME (an empty folder): "no server runs" is its documented exit 1.
    "server status": cmd("server", "status", redis=1, sql=1, schema=1),
    "server stop": cmd("server", "stop", sql=0, schema=0),
    "events consumers": cmd("events", "consumers"),
    "events parked": cmd("events", "parked"),
    "events requeue": cmd("events", "requeue", "contract", "1", redis=2),
    "events discard": cmd("events", "discard", "contract", "1", redis=2),
    "payments refused": cmd("payments", "refused", "--since", "7d"),
    # No payment of that order was refused: exit 2, unless SQL fails first.
    "payments handled": cmd("payments", "handled", "{order}", "--ref", "psp-1", redis=2),
    # SQL is the record: with Redis failing the limit is set, its copy left to reconcile.
    "limit set": cmd("limit", "set", "{user}", "2"),
    "limit show": cmd("limit", "show", "{user}"),
    "limit clear": cmd("limit", "clear", "{user}"),
    "limit history": cmd("limit", "history", "{user}"),
    "resource set": cmd("resource", "set", "r:{user}", "--capacity", "3"),
    # No resource of that id: exit 3 (not found), unless SQL fails first.
    "resource show": cmd("resource", "show", "r:{user}", redis=3),
    "resource list": cmd("resource", "list", "--limit", "5"),
    "resource units": cmd("resource", "units", "u:{user}", "A-1", "A-2"),
    # No resource or entry of that id: exit 3 (not found), unless SQL fails first.
    "waiting show": cmd("waiting", "show", "r:{user}", redis=3),
    "waiting add": cmd("waiting", "add", "{user}", "r:{user}", redis=3),
    "waiting leave": cmd("waiting", "leave", str(2**62), redis=3),
    # A pause that succeeded would stay open in the module's shared database (and hold
    # every sweep in it), so the row takes the refusal path: a blank reason, exit 2 once
    # the service is built. tests/e2e/test_cli.py and test_pauses.py run the real pause.
    "pause": cmd("pause", "--reason", " ", redis=2),
    "resume": cmd("resume", redis=2),  # nothing is paused
    "pauses": cmd("pauses"),
    "prune": cmd("prune", "--older-than", "3650d", "--dry-run"),
    "erase-user": cmd("erase-user", "{user}", redis=8, redis_wrong_type=0),
    "scheduler": cmd("scheduler"),
    "dashboard": cmd("dashboard", "--port", "0"),
    "demo": cmd("demo", "--fast"),
    # It looks at the database first and refuses one holding orders (exit 2, one line)
    # before it touches Redis.
    "bench": cmd("bench", "--quick", redis=2),
}


def test_every_command_has_a_row() -> None:
    assert set(ALL_COMMANDS) == set(COMMANDS)


CLI_CASES = [
    pytest.param(name, failure, id=f"{name.replace(' ', '-')}-{failure}")
    for name in sorted(COMMANDS)
    for failure in FAILURES
    if failure not in SKIPPED.get(name, ())
]


def assert_one_error_line(result: Any, expected_exit: int) -> None:
    shown = f"exit {result.exit_code}, stderr {result.stderr[-800:]!r}, {result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    assert result.exit_code == expected_exit, shown
    assert "Traceback" not in result.output, shown
    if expected_exit not in (0, 1):
        assert result.stderr.startswith("error: "), shown
        assert result.stderr.count("\n") == 1, shown
        assert result.stderr.endswith("\n"), shown


def invoke(args: list[str], env: dict[str, str]) -> Any:
    return CliRunner().invoke(main, args, env=env, catch_exceptions=True)


@pytest.mark.rotate("stores")
@pytest.mark.parametrize(("name", "failure"), CLI_CASES)
def test_command_exits_with_one_line_on_store_failure(
    stores: Stores, tmp_path: Path, name: str, failure: str
) -> None:
    spec, row = FAILURES[failure], COMMANDS[name]
    user, order_id = healthy_order(stores)
    spec.spoil(stores, user)
    database = spec.database(stores)
    if row.migrates and failure == "sql_no_schema":
        database = stores.new_empty_db()
    env = {
        "ORDERS_HOME": str(tmp_path / "home"),
        "ORDERS_DATABASE_URL": database,
        "ORDERS_REDIS_URL": spec.redis(stores),
        "ORDERS_REDIS_SOCKET_TIMEOUT_S": SOCKET_TIMEOUT_S,
        "ORDERS_ERASURE_KEY": ERASURE_KEY,
    }
    args = [a.format(user=user, order=order_id) for a in row.args]
    assert_one_error_line(invoke(args, env), row.exits[failure])


# --- malformed settings -------------------------------------------------------------------

#: One or more malformed values per setting: non-numeric, out of range, not finite, bad URL
#: scheme, unknown dialect, bad bool.
MALFORMED: list[tuple[str, str]] = [
    ("ORDERS_DATABASE_URL", "nosuchdialect://db/shop"),
    ("ORDERS_DATABASE_URL", "not a url"),
    ("ORDERS_REDIS_URL", "http://cache:6379/0"),
    ("ORDERS_REDIS_URL", "redis://cache:port/0"),
    ("ORDERS_REDIS_CLUSTER", "maybe"),
    ("ORDERS_UNPAID_LIMIT", "three"),
    ("ORDERS_UNPAID_LIMIT", "0"),
    ("ORDERS_TTL_S", "nan"),
    ("ORDERS_TTL_S", "-1"),
    ("ORDERS_MAX_TTL_S", "1"),  # below the default TTL
    ("ORDERS_REMIND_BEFORE_S", "0"),
    ("ORDERS_REMIND_BEFORE_S", "1800"),  # not below the default TTL
    ("ORDERS_KEY_PREFIX", "Unpaid {Order}-"),
    ("ORDERS_MAX_USER_ID_LENGTH", "513"),
    ("ORDERS_MAX_ORDER_ID_LENGTH", "12.5"),
    ("ORDERS_MAX_METADATA_BYTES", "-1"),
    ("ORDERS_STRICT_EXPIRY", "maybe"),
    ("ORDERS_CREATE_WITHOUT_REDIS", "2"),
    ("ORDERS_COMBINE_CREATES", "sometimes"),
    ("ORDERS_COMBINE_TRANSITIONS", "often"),
    ("ORDERS_SWEEP_BATCH_SIZE", "0"),
    ("ORDERS_ON_CLOSED", "shop stock release"),
    ("ORDERS_ON_PAYMENT_REFUSED", "shop refunds issue"),
    ("ORDERS_LATE_PAYMENT_WINDOW_S", "-5"),
    ("ORDERS_EVENT_MAX_ATTEMPTS", "0"),
    ("ORDERS_MAX_LIFETIME_S", "-5"),
    ("ORDERS_PRE_CLOSE_TIMEOUT_S", "0"),
    ("ORDERS_MAX_EXTENSION_S", "ten"),
    ("ORDERS_SWEEP_INTERVAL_S", "soon"),
    ("ORDERS_LEASE_TTL_S", "0"),
    ("ORDERS_RECONCILE_INTERVAL_S", "1e400"),
    ("ORDERS_REDIS_SOCKET_TIMEOUT_S", "-0.5"),
    ("ORDERS_SQL_POOL_SIZE", "0"),
    ("ORDERS_SQL_MAX_OVERFLOW", "-1"),
    ("ORDERS_SQL_POOL_TIMEOUT_S", "nan"),
    ("ORDERS_SQL_STATEMENT_TIMEOUT_S", "-1"),
    ("ORDERS_SQL_CONNECT_TIMEOUT_S", "-1"),
    ("ORDERS_SQL_BUSY_TIMEOUT_S", "ten"),
    ("ORDERS_SQL_IDLE_IN_TRANSACTION_TIMEOUT_S", "5"),  # not below the lease (5 s)
    ("ORDERS_SQL_LOCK_TIMEOUT_S", "-1"),
    ("ORDERS_AIO_THREADS", "0"),
    ("ORDERS_AIO_QUEUE", "-1"),
    ("ORDERS_CREATE_RATE", "0/0"),
    ("ORDERS_ON_LIMIT", "newest"),
    ("ORDERS_POLICIES", '{"card": {"ttl_s": -1}}'),
    ("ORDERS_RETENTION_DAYS", "-1"),
    ("ORDERS_WEBHOOK_URL", "ftp://hooks.example/orders"),
    ("ORDERS_WEBHOOK_URL", "https://hooks.example/orders"),  # without a secret
    ("ORDERS_WEBHOOK_SECRET", "too-short-secret"[:15]),
    ("ORDERS_WEBHOOK_KINDS", "shipped"),
    ("ORDERS_WEBHOOK_TIMEOUT_S", "0"),
    ("ORDERS_ERASURE_KEY", "too-short-erasure-key"[:15]),
]
#: Settings any value of which is well formed.
ANY_VALUE = {"home"}  # a folder name; created (or refused as a store failure) when used
#: Fields with no variable: the default policy's are read from those of its fields
#: (``ORDERS_TTL_S``, ...), all but ``expires``.
NO_VARIABLE = {"default_policy", "expires"}
#: Read by the command line only (options of ``main`` or of one command), not Settings.
CLI_MALFORMED: list[tuple[str, str, tuple[str, ...]]] = [
    ("ORDERS_LOG_FORMAT", "xml", tuple(ALL_COMMANDS)),
    ("ORDERS_OPS_PORT", "http", ("scheduler",)),
]
#: Commands that read no setting but ORDERS_HOME (and main's log format): ``demo`` always
#: builds its own Settings on the embedded stores (README), so it is run only with those.
IGNORES_SETTINGS = {"demo"}


def test_every_setting_has_a_malformed_row() -> None:
    covered = {var for var, _ in MALFORMED}
    read = [*fields(Settings), *fields(ExpiryPolicy)]
    assert {f"ORDERS_{f.name.upper()}" for f in read} - covered == {
        f"ORDERS_{name.upper()}" for name in ANY_VALUE | NO_VARIABLE
    }


@pytest.mark.parametrize(("var", "value"), MALFORMED, ids=[f"{v}={x}" for v, x in MALFORMED])
def test_malformed_setting_is_invalid_input(var: str, value: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        Settings.from_env({var: value})
    assert type(refused.value) is InvalidInput
    assert len(value) < 3 or value not in str(refused.value)


def test_module_functions_refuse_a_malformed_setting(
    module_env: pytest.MonkeyPatch, tmp_path: Path, closed_port: int
) -> None:
    """``orders``' and ``orders.aio``'s functions build their default service from
    ``ORDERS_*`` (each through its ``default_service``, so one function stands for all):
    a malformed value is InvalidInput, before the stores (which would fail) are touched."""
    module_env.setenv("ORDERS_DATABASE_URL", f"sqlite:///{tmp_path / 'no-such-folder' / 'o.db'}")
    module_env.setenv("ORDERS_REDIS_URL", f"redis://127.0.0.1:{closed_port}/0")

    def create_sync() -> Outcome:
        orders.configure(None)
        return outcome_of(lambda: orders.create_unpaid_order("u1"))

    def create_aio() -> Outcome:
        orders.aio.configure(None)
        return run_checked(awaited_outcome(lambda: orders.aio.create_unpaid_order("u1")))

    got: dict[str, str] = {}
    for var, value in MALFORMED:
        with module_env.context() as env:
            env.setenv(var, value)
            for api, create in (("orders", create_sync), ("orders.aio", create_aio)):
                got[f"{api} {var}={value}"] = name_of(create())
    assert got == dict.fromkeys(got, name_of(InvalidInput))
    assert len(got) == 2 * len(MALFORMED)


SETTING_CASES = [
    pytest.param(name, var, value, id=f"{name.replace(' ', '-')}-{var}={value}")
    for name in ALL_COMMANDS
    if name not in IGNORES_SETTINGS
    for var, value in MALFORMED
] + [
    pytest.param(name, var, value, id=f"{name.replace(' ', '-')}-{var}={value}")
    for var, value, names in CLI_MALFORMED
    for name in names
]


@pytest.mark.timeout(10)  # the scheduler must refuse at once, not start
# CI time: each malformed value on one command, the next value on the next command (every
# command with every value: --full). Settings are read in one place, so a command that
# refuses one malformed value refuses them all the same way.
@pytest.mark.rotate("name")
@pytest.mark.parametrize(("name", "var", "value"), SETTING_CASES)
def test_command_exits_2_on_one_line_for_a_malformed_setting(
    tmp_path: Path, closed_port: int, name: str, var: str, value: str
) -> None:
    # Stores that would fail (exit 8) if a command got past its settings.
    env = {
        "ORDERS_HOME": str(tmp_path / "home"),
        "ORDERS_DATABASE_URL": f"sqlite:///{tmp_path / 'no-such-folder' / 'orders.db'}",
        "ORDERS_REDIS_URL": f"redis://127.0.0.1:{closed_port}/0",
        var: value,
    }
    args = [a.format(user="u1", order="o1") for a in COMMANDS[name].args]
    result = invoke(args, env)
    assert_one_error_line(result, 2)
    assert len(value) < 3 or value not in result.stderr


# --- as real processes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "setting", "exit_status"),
    [
        (("scheduler",), {"ORDERS_UNPAID_LIMIT": "three"}, 2),
        (("scheduler",), {"ORDERS_LOG_FORMAT": "xml"}, 2),
        (("create", "u1"), {"ORDERS_REDIS_URL": "unix:///nonexistent-orders-dir/r.sock"}, 8),
    ],
    ids=["scheduler-malformed-limit", "scheduler-malformed-log-format", "create-redis-down"],
)
def test_real_process_prints_one_line_and_exits(
    stores: Stores,
    tmp_path: Path,
    args: tuple[str, ...],
    setting: dict[str, str],
    exit_status: int,
) -> None:
    stores_env = {
        "ORDERS_HOME": str(tmp_path / "home"),
        "ORDERS_DATABASE_URL": stores.healthy_db,
        "ORDERS_REDIS_URL": stores.redis_url,
        "ORDERS_REDIS_SOCKET_TIMEOUT_S": SOCKET_TIMEOUT_S,
    }
    env = child_env(**(stores_env | setting))
    done = run_orders(*args, env=env, timeout_s=20)
    assert (done.returncode, done.stderr.count("\n")) == (exit_status, 1), done.stderr[-800:]
    assert done.stderr.startswith("error: "), done.stderr[-800:]
