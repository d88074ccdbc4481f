"""Contention through the asyncio API: many tasks on one event loop, one AsyncOrderService.

:func:`contend` runs ``creators`` tasks that create orders for one user in bursts (every
task wakes on the same loop-clock ticks), while payer and canceller tasks take the orders
they saw created (split by :func:`tests.support.tally.bucket`: pay, cancel, or left
to expire) and a sweeper task closes the expired ones. Everything is counted in a
:class:`~tests.support.tally.Tally`, whose JSON form is what the tests check.

Used in process by ``tests/concurrency/test_async_contention.py``, and as a worker process
(``python -m tests.support.workers.aio contend CONFIG_JSON``) with the protocol of
``tests/support/processes.py``: ``READY``, then ``GO`` on stdin, then one JSON line of
counts. A worker runs its own event loop in asyncio's debug mode and reports the callbacks
that held it longer than 20 ms (``slow_callbacks``) instead of failing on them.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from redis.cluster import RedisCluster

from orders.aio import AsyncOrderService
from orders.domain import Order, OrderStatus
from orders.errors import OrderClosed, UnpaidOrderLimitReached
from tests.support.tally import Tally, bucket, split

T = TypeVar("T")

#: The counters and lists of one contend run (the worker's JSON result).
COUNTS = (
    "attempts",
    "admitted",
    "refused",
    "sql_refused",
    "sql_short",
    "paid",
    "cancelled",
    "closed",
    "pay_lost",
    "cancel_lost",
    "sweeps",
    "sweep_redis_errors",
    "max_in_flight",
)


def new_tally(name: str) -> Tally:
    counts: dict[str, Any] = dict.fromkeys(COUNTS, 0)
    return Tally(name=name, **counts, admitted_ids=[], paid_refs={}, cancelled_ids=[])


def check_created(order: Order, user: str, ttl_ms: int) -> str | None:
    """What is odd about an order a create returned (None: nothing)."""
    if (
        order.user_id != user
        or order.status is not OrderStatus.UNPAID
        or order.expires_at_ms - order.created_at_ms != ttl_ms
    ):
        return f"odd order returned: {order!r}"
    return None


def count_refusal(tally: Tally, exc: UnpaidOrderLimitReached, limit: int) -> None:
    """Count a refusal; one not at the limit it was given is an error.

    But for one case, counted as ``sql_short``: the SQL guard gives up after a few rounds
    of finding its slot taken again (``OrderRecords.insert_guarded``), and then reports the
    live holders it saw last, which may be fewer than the limit. Under hundreds of tasks
    (and a create whose clock reading is old by the time it reaches SQL) that happens.
    """
    tally.add("refused")
    if exc.source == "sql":
        tally.add("sql_refused")
    if exc.limit == limit and exc.open_count < limit and exc.source == "sql":
        tally.add("sql_short")
    elif exc.limit != limit or exc.open_count < limit:
        tally.error("create", f"refused with {exc.open_count} of {exc.limit} ({exc.source})")


#: Tasks started per step of the loop (in debug mode a task's creation records its stack:
#: five hundred at once would hold the loop for tens of milliseconds).
SPAWN_BATCH = 50


async def spawn(jobs: Iterable[Coroutine[Any, Any, T]]) -> list[asyncio.Task[T]]:
    """A task for each job, :data:`SPAWN_BATCH` at a time, yielding to the loop between."""
    tasks: list[asyncio.Task[T]] = []
    for job in jobs:
        tasks.append(asyncio.ensure_future(job))
        if len(tasks) % SPAWN_BATCH == 0:
            await asyncio.sleep(0)
    return tasks


async def contend(
    service: AsyncOrderService,
    cfg: dict[str, Any],
    tally: Tally,
    *,
    before_sweep: Callable[[], object] | None = None,
    after_create: Callable[[], object] | None = None,
) -> None:
    """The run the module docstring describes; returns when every task has ended.

    ``cfg``: ``user``, ``limit``, ``creators`` (tasks), ``attempts`` (in all), ``ttl_ms``
    [lo, hi] (in the service's clock), ``tick_s`` and ``spread_ticks`` (each attempt waits
    1..spread_ticks tick boundaries), ``payers``, ``cancellers``, ``hold_s`` [lo, hi] (how
    long a payer or canceller lets an order hold its slot first), ``sweep_every_s``
    [lo, hi], ``seed``, ``name``. ``before_sweep`` runs before each sweep, ``after_create``
    after each attempt to create, whatever its outcome (a test moves its clock in one of
    them: in the second, time passes with the run's progress, as fast on a slow machine as
    on a fast one).
    """
    name, user, limit = cfg["name"], cfg["user"], cfg["limit"]
    seed = f"{cfg['seed']}-{name}"
    loop = asyncio.get_running_loop()
    tick_s = cfg["tick_s"]
    queues: dict[str, asyncio.Queue[str | None]] = {
        "pay": asyncio.Queue(),
        "cancel": asyncio.Queue(),
    }
    creators_done = asyncio.Event()
    # Time enough to start every creator task first (~0.1 ms each in debug mode).
    start_at = loop.time() + 0.05 + cfg["creators"] * 0.0002
    in_flight = [0]

    async def create(rng: random.Random) -> None:
        ttl_ms = rng.randint(*cfg["ttl_ms"])
        tally.add("attempts")
        in_flight[0] += 1
        tally.data["max_in_flight"] = max(tally.data["max_in_flight"], in_flight[0])
        try:
            order = await service.create_unpaid_order(user, ttl_s=ttl_ms / 1000, limit=limit)
        except UnpaidOrderLimitReached as exc:
            count_refusal(tally, exc, limit)
        except Exception as exc:
            tally.error("create", exc)
        else:
            tally.add("admitted")
            tally.append("admitted_ids", order.id)
            if odd := check_created(order, user, ttl_ms):
                tally.error("create", odd)
            fate = bucket(order.id)
            if fate in queues:
                queues[fate].put_nowait(order.id)
        finally:
            in_flight[0] -= 1
            if after_create is not None:
                after_create()

    async def creator(number: int, attempts: int) -> None:
        rng = random.Random(f"{seed}-creator-{number}")
        # The first attempts of all the tasks at once. (A timer each, not one Event: in debug
        # mode, waking five hundred waiters of an Event is one callback of ~20 ms.)
        await asyncio.sleep(start_at - loop.time())
        for n in range(attempts):
            if n > 0:
                # Then on a tick boundary a few ticks ahead: the tasks that drew the same
                # tick wake together, so the creates keep arriving in bursts.
                ticks = rng.randint(1, cfg["spread_ticks"])
                await asyncio.sleep(tick_s * (ticks - (loop.time() / tick_s) % 1))
            await create(rng)

    async def payer(number: int) -> None:
        rng = random.Random(f"{seed}-payer-{number}")
        while (order_id := await queues["pay"].get()) is not None:
            await asyncio.sleep(rng.uniform(*cfg["hold_s"]))
            ref = f"{name}-pay-{order_id}"
            try:
                paid = await service.mark_paid(order_id, payment_ref=ref)
            except OrderClosed:  # the sweep (or a create taking its slot) closed it first
                tally.add("pay_lost")
            except Exception as exc:
                tally.error("mark_paid", exc)
            else:
                if paid.status is not OrderStatus.PAID or paid.payment_ref != ref:
                    tally.error("mark_paid", f"odd order returned: {paid!r}")
                tally.add("paid")
                tally.put("paid_refs", order_id, ref)

    async def canceller(number: int) -> None:
        rng = random.Random(f"{seed}-canceller-{number}")
        reason = f"{name}-cancel"
        while (order_id := await queues["cancel"].get()) is not None:
            await asyncio.sleep(rng.uniform(*cfg["hold_s"]))
            try:
                cancelled = await service.cancel_order(order_id, reason=reason)
            except OrderClosed:
                tally.add("cancel_lost")
            except Exception as exc:
                tally.error("cancel_order", exc)
            else:
                if (
                    cancelled.status is not OrderStatus.CANCELLED
                    or cancelled.close_reason != reason
                ):
                    tally.error("cancel_order", f"odd order returned: {cancelled!r}")
                tally.add("cancelled")
                tally.append("cancelled_ids", order_id)

    async def sweeper() -> None:
        rng = random.Random(f"{seed}-sweeper")
        while not creators_done.is_set():
            await asyncio.sleep(rng.uniform(*cfg["sweep_every_s"]))
            if before_sweep is not None:
                before_sweep()
            try:
                result = await service.sweep_expired()
            except Exception as exc:
                tally.error("sweep_expired", exc)
                continue
            tally.add("sweeps")
            tally.add("closed", result.closed)
            tally.add("sweep_redis_errors", result.redis_errors)

    async def counted(what: str, job: Any) -> None:
        try:
            await job
        except Exception as exc:
            tally.error(f"{what} crashed", exc)

    helpers = [
        *(counted("payer", payer(n)) for n in range(cfg["payers"])),
        *(counted("canceller", canceller(n)) for n in range(cfg["cancellers"])),
        counted("sweeper", sweeper()),
    ]
    helper_tasks = await spawn(helpers)
    per_creator = split(cfg["attempts"], cfg["creators"])
    await asyncio.gather(
        *await spawn(counted("creator", creator(n, a)) for n, a in enumerate(per_creator))
    )
    creators_done.set()
    for fate, queue in queues.items():
        for _ in range(cfg["payers"] if fate == "pay" else cfg["cancellers"]):
            queue.put_nowait(None)
    await asyncio.gather(*helper_tasks)


# ============================================================================================
# The worker process.
# ============================================================================================


async def widen_redis_pools(service: AsyncOrderService, connections: int) -> None:
    """Let the service's Redis client open up to ``connections`` connections to each node.

    A workaround: redis-py 8 caps a connection pool at 100 connections, and the client
    orders.aio runs the core's Redis calls on fails a call beyond that (MaxConnectionsError,
    retried once, then StoreUnavailable) instead of waiting for a connection to come back;
    ``test_more_concurrent_calls_than_redis_connections_all_succeed`` shows it. The
    contention tests are about the limit, so they give the pools room.
    """
    client = (await service.core()).index.client
    if isinstance(client, RedisCluster):
        pools = [node.redis_connection.connection_pool for node in client.get_nodes()]
    else:
        pools = [client.connection_pool]
    for pool in pools:
        pool.max_connections = connections  # type: ignore[attr-defined]


async def warm_up(
    service: AsyncOrderService, user: str, name: str = "loop", connections: int = 0
) -> None:
    """Connect both stores and take each path once before the run (for a user of its own,
    ``name``'s, whose orders end paid or cancelled), so that no call of the run waits for
    a first connect or spends its step compiling SQL; open ``connections`` Redis
    connections too (see :func:`open_redis_connections`)."""
    await service.redis_client.ping()  # type: ignore[misc]
    await service.list_unpaid(user)
    other = f"{user}-warm-up-{name}"
    order = await service.create_unpaid_order(other, ttl_s=60, limit=1)
    await service.mark_paid(order.id, payment_ref="warm-up")
    order = await service.create_unpaid_order(other, ttl_s=60, limit=1)
    await service.cancel_order(order.id, reason="warm-up")
    await service.sweep_expired()
    await service.reconcile()
    await open_redis_connections(service, user, connections)


async def open_redis_connections(
    service: AsyncOrderService, user: str, count: int, step: int = 100
) -> None:
    """Let the core's Redis client open ``count`` connections to the node of ``user``'s
    key, ``step`` more at a time (a ZCARD from that many threads at once, for each
    level): the pool of a service past its first bursts. Five hundred first connects in
    one burst would otherwise be the run's first step, not what it measures."""
    core = await service.core()
    key = core.index.key(user)
    loop = asyncio.get_running_loop()
    for level in range(step, count + step, step):
        at_once = min(level, count)
        start_at = loop.time() + 0.02 + at_once * 0.0002

        async def one(start_at: float = start_at) -> None:
            await asyncio.sleep(start_at - loop.time())
            await service.calls.call(core.index.client.zcard, key)

        await asyncio.gather(*await spawn(one() for _ in range(at_once)))


def main(argv: list[str]) -> int:
    mode, cfg = argv[0], json.loads(argv[1])
    if mode != "contend":
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    from orders.config import Settings  # noqa: PLC0415
    from tests.support.aio import checked_runner, new_async_service, no_slow_callbacks  # noqa: PLC0415

    settings = Settings.from_env(
        sql_pool_size=cfg.get("pool_size", 5), sql_max_overflow=cfg.get("max_overflow", 10)
    )
    tally = new_tally(cfg["name"])
    with checked_runner() as runner:
        service = runner.run(new_async_service(settings))
        try:
            runner.run(warm_up(service, cfg["user"], cfg["name"]))
            print("READY", flush=True)
            line = sys.stdin.readline()
            if not line.startswith("GO"):
                print(f"expected GO, got {line[:40]!r}", file=sys.stderr)
                return 2
            started = time.monotonic()
            with no_slow_callbacks(fail=False) as slow:  # the run's callbacks, not start-up's
                deadline_s = cfg.get("deadline_s", 120)
                runner.run(asyncio.wait_for(contend(service, cfg, tally), deadline_s))
            tally.data["elapsed_s"] = round(time.monotonic() - started, 3)
        finally:
            runner.run(service.aclose())
    tally.data["slow_callbacks"] = slow.reports[:10]
    tally.data["slow_callback_count"] = len(slow.reports)
    print(json.dumps(tally.data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
