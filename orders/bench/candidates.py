"""The ``aio`` figure: the ways :mod:`orders.aio` can run a create, side by side.

All in one interleaved measure, on the configured engine: the synchronous create on 1 and
8 threads; :class:`~orders.aio.AsyncOrderService` (whatever it runs on) as 1, 16 and 64
tasks on the bench's one event loop; ``asyncio.to_thread`` over the synchronous service as
16 and 64 tasks (a reference: the least a thread-pool design can do); the native floor
(:mod:`orders.bench.native`) as 1, 16 and 64 tasks, an upper bound for a native design on
``redis.asyncio`` and ``AsyncEngine``, since it skips validation, compensation, the SQL
guard and metrics; and a refusal at the limit, synchronous (1 thread) and async (1 task).

Every variant's SQL statements are counted on every engine of the process (the class
``Engine``: whichever engine the async service runs on is counted too), so a refusal's 0
means no statement at all; a create's count shows the counter saw that engine.

The ratios are per repetition, as everywhere in the bench; :data:`TARGETS` are the bounds
the choice of design is held to, by engine (:mod:`orders.bench.report` checks them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from orders.bench import floors, variants
from orders.bench.measure import Variant, counted, describe, ratios, spread
from orders.bench.workload import Workload

SYNC_THREADS = (1, 8)
ASYNC_TASKS = (1, 16, 64)
TO_THREAD_TASKS = (16, 64)


def on_threads(kind: str, n: int) -> str:
    """A variant's name at ``n`` threads: ``create_sync_8thr``."""
    return f"{kind}_{n}thr"


def on_tasks(kind: str, n: int) -> str:
    """A variant's name at ``n`` tasks: ``create_async_1task``, ``native_floor_64tasks``."""
    return f"{kind}_{n}task{'s' * (n != 1)}"


def count_of(name: str) -> str:
    """``create_sync_8thr`` -> ``8 threads``, ``create_async_1task`` -> ``1 task``."""
    count = name.rpartition("_")[2]
    n = count.rstrip("thraskd")
    unit = "thread" if count.endswith("thr") else "task"
    return f"{n} {unit}{'s' * (n != '1')}"


#: What each kind of variant is, as the tables say it (its count is appended).
KINDS = {
    "create_sync": "create, sync service on threads",
    "create_async": "create, AsyncOrderService, tasks on one loop",
    "create_to_thread": "create, asyncio.to_thread(sync service), reference",
    "native_floor": (
        "native floor, UPPER BOUND for a native orders.aio (EVALSHA + INSERT order and "
        "event on redis.asyncio / AsyncEngine; no validation, compensation, SQL guard or "
        "metrics)"
    ),
    "refusal_sync": "refusal at the limit, sync service",
    "refusal_async": "refusal at the limit, AsyncOrderService",
}

#: The variants, in the order they take turns.
NAMES = (
    *(on_threads("create_sync", n) for n in SYNC_THREADS),
    *(on_tasks("create_async", n) for n in ASYNC_TASKS),
    *(on_tasks("create_to_thread", n) for n in TO_THREAD_TASKS),
    *(on_tasks("native_floor", n) for n in ASYNC_TASKS),
    on_threads("refusal_sync", 1),
    on_tasks("refusal_async", 1),
)


def label(name: str) -> str:
    """The tables' label of a variant: its kind, then its thread or task count."""
    kind = name.rpartition("_")[0]
    return f"{KINDS[kind]}, {count_of(name)}"


def _pairs() -> tuple[tuple[str, str], ...]:
    one, eight = on_threads("create_sync", 1), on_threads("create_sync", 8)
    found: list[tuple[str, str]] = [
        (on_tasks("create_async", 1), one),
        (on_tasks("native_floor", 1), one),
    ]
    for n in (16, 64):
        mine = on_tasks("create_async", n)
        others = (on_tasks("create_to_thread", n), on_tasks("native_floor", n))
        found += [(name, sync) for name in (mine, *others) for sync in (one, eight)]
        found += [(mine, other) for other in others]
    found.append((on_tasks("refusal_async", 1), on_threads("refusal_sync", 1)))
    return tuple(found)


#: The ratios the figure reports, ``(a, b)``: a's ops/s over b's, per repetition.
PAIRS = _pairs()


def ratio_key(a: str, b: str) -> str:
    return f"{a}_vs_{b}"


@dataclass(frozen=True, slots=True)
class Target:
    """A bound on one ratio of the figure, by engine (an engine not named: PostgreSQL's;
    None: no bound on that engine)."""

    id: str
    mine: str
    against: str
    bounds: Mapping[str, float | None]

    @property
    def ratio(self) -> str:
        return ratio_key(self.mine, self.against)

    def bound(self, engine: str) -> float | None:
        return self.bounds.get(engine, self.bounds.get("postgresql"))


def _target(id_: str, mine: str, against: str, postgresql: float, sqlite: float | None) -> Target:
    return Target(id_, mine, against, {"postgresql": postgresql, "sqlite": sqlite})


_SYNC_1, _SYNC_8 = on_threads("create_sync", 1), on_threads("create_sync", 8)
_ASYNC_16, _ASYNC_64 = on_tasks("create_async", 16), on_tasks("create_async", 64)

#: The targets the design of orders.aio is chosen by.
TARGETS = (
    _target("aio_create_16_vs_sync_1", _ASYNC_16, _SYNC_1, 1.4, 1.0),
    _target("aio_create_64_vs_sync_1", _ASYNC_64, _SYNC_1, 1.4, None),
    _target("aio_create_16_vs_sync_8", _ASYNC_16, _SYNC_8, 1.0, None),
    _target("aio_create_64_vs_sync_8", _ASYNC_64, _SYNC_8, 1.0, None),
    _target(
        "aio_refusal_vs_sync", on_tasks("refusal_async", 1), on_threads("refusal_sync", 1), 0.8, 0.8
    ),
)
#: The create whose p99 latency is reported beside the targets.
P99_OF = _ASYNC_64


def target_name(target: Target) -> str:
    """``aio: async create, 16 tasks / sync, 1 thread``."""
    kind = target.mine.partition("_")[0]
    return f"aio: async {kind}, {count_of(target.mine)} / sync, {count_of(target.against)}"


def target_of(a: str, b: str, engine: str) -> tuple[Target, float] | None:
    """The target on the ratio a / b on ``engine``, with its bound, if there is one."""
    for target in TARGETS:
        bound = target.bound(engine)
        if (target.mine, target.against) == (a, b) and bound is not None:
            return target, bound
    return None


def met(measured: float, bound: float) -> str:
    """How the tables say it: ``met`` or ``missed`` (``measured >= bound``)."""
    return "met" if measured >= bound else "missed"


def _variants(w: Workload) -> dict[str, Variant]:
    made: dict[str, Variant] = {}
    for n in SYNC_THREADS:
        made[on_threads("create_sync", n)] = variants.create(w, n)
    for n in ASYNC_TASKS:
        made[on_tasks("create_async", n)] = variants.create(w, tasks=n)
    for n in TO_THREAD_TASKS:
        made[on_tasks("create_to_thread", n)] = variants.to_thread_create(w, n)
    for n in ASYNC_TASKS:
        made[on_tasks("native_floor", n)] = floors.native_floor(w, n)
    made[on_threads("refusal_sync", 1)] = variants.refusal(w)
    made[on_tasks("refusal_async", 1)] = variants.refusal(w, tasks=1)
    return made


def aio(w: Workload) -> dict[str, Any]:
    """The figure: every variant of :data:`NAMES` in one measure, the ratios of
    :data:`PAIRS`, and each variant's SQL statements."""
    statements = {name: [0] for name in NAMES}
    made = _variants(w)
    chosen = {name: counted(Engine, made[name], statements[name]) for name in NAMES}
    runs = w.measure("aio: sync 1/8 threads, async 1/16/64 tasks, to_thread, native", chosen)
    return {
        "ops_per_rep": w.sizes.ops,
        "ops_per_variant": w.ops_per_variant,
        "variants": {name: describe(runs[name]) for name in NAMES},
        "sql_statements": {name: statements[name][0] for name in NAMES},
        "ratios": {ratio_key(a, b): spread(ratios(runs[a], runs[b])) for a, b in PAIRS},
    }
