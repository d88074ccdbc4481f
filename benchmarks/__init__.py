"""The benchmark lab: what the service costs, measured against its floors, figure by figure.

Not installed with the package (``orders bench`` is the small command users get): run it
from a checkout, ``python -m benchmarks --help``, on the stores the ``ORDERS_*`` variables
name. It may import any part of ``orders``; ``orders`` never imports it (an import-linter
contract in pyproject.toml). README.md beside this file says how it measures and what it
found.

Every comparison runs side by side in one process: the variants of a figure take turns
(A B C A B C ...) for several repetitions, so a machine that slows down or speeds up during
the run affects each of them alike. Each figure reports the median over the repetitions and
the min-max, and every ratio is computed per repetition (A_r / B_r) before its median is
taken, so a ratio holds on a noisy machine even when the absolute figures wander.

The figures, each with what it is compared with:

1. ``create``: ``create_unpaid_order`` end to end (every op a new user, so every op is
   admitted) on 1 thread, on N and, on PostgreSQL, on 8 (commits can share an fsync),
   against the raw floor measured in the same run (``floor``: one EVALSHA of the admission
   script, then the raw DBAPI driver inserting the order row and its ``created`` event in
   one committed transaction, see :mod:`benchmarks.driver`), the same work through
   SQLAlchemy Core (``floor_core``), and the naive approach (ZCARD, then ZADD from the
   client, then a Core INSERT of the order row). Beside them, ``create_async``: the same
   create through :class:`~orders.aio.AsyncOrderService` as 1 task (awaited in turn) and
   as ``--tasks`` N tasks gathered on one event loop, against the same floors of the same
   run (at the most threads not above N, see :mod:`benchmarks.concurrency`).
2. ``refusal``: a create refused at the limit, and the SQL statements it issued (should be
   none), with and without a caller-supplied ``order_id`` (which may cost one read by
   primary key), against one raw EVALSHA that refuses; and ``refusal_async`` at 1 and N
   tasks, against the same EVALSHA.
3. ``mark_paid`` and ``cancel``: each end to end against the raw driver's ``UPDATE ...
   WHERE status = 'unpaid'`` plus its event row, in one committed transaction.
4. ``callers``: create, mark_paid and refusal at 1, 8 and 64 concurrent callers, as
   threads and as tasks of the asyncio API, each beside its floor on as many threads, with
   p50 and p99 latency per caller (:mod:`benchmarks.callers`).
5. ``sweep``: closes per second of ``sweep_expired`` per batch size, on a table of many
   unpaid orders of which a fixed number are due, then on a table ten times larger with the
   same number due (the cost should stay flat), then on the first size again: a table cannot
   grow and shrink between two sweeps, so the sizes take turns as phases (1x 10x 1x).
6. ``close_lag``: ``closed_at - expires_at`` with a real
   :class:`~orders.scheduler.sweeper.Sweeper` in an APScheduler background scheduler while
   orders expire at a steady rate (every order's lag is kept, with when it fell due, for the
   plot).
7. ``redis_memory``: Redis ``used_memory`` per open order, with 1 and 3 orders per user.
8. ``sql_admission``: the SQL guard alone (``records.insert_guarded``, no Redis) as a peer
   of the Redis path, for refusals and for admissions.
9. ``holds`` (issue 43): a sold-out hold refused by the index beside the raw EVALSHA, a
   create with 1 hold and with a 10-resource cart beside one without, and one hot SKU
   under 64 threads beside creates without holds, a raw hold and the commit time
   (:mod:`benchmarks.holds`).
10. ``waiting`` (issue 44): from an order's deadline to the waiting user's new order while
   orders expire at ``--lag-rate`` per second, on many counted resources and on one named
   one, beside the close lag of the same run, every entry checked served exactly once
   (:mod:`benchmarks.waiting`).

(The ``aio`` figure, which set ``AsyncOrderService`` beside ``asyncio.to_thread`` and a
native ``redis.asyncio``/``AsyncEngine`` floor to choose a design, went with issue 42:
issue 26 chose, and the shipped async service is measured in ``create``, ``refusal`` and
``callers``.)

Besides wall-clock figures, each variant reports the client's CPU time per operation: on a
busy machine the wall clock of every variant suffers, the CPU time hardly.

What the bench writes is its own: users ``bench-<random>-...``, orders whose ids it made,
Redis keys under ``<key prefix>bench-<random>-``. The sweep figure runs the service with a
clock stopped in 2001 (``SWEEP_NOW_MS``) and the close-lag figure with one running at real
speed from that date, so the only orders due in their eyes are the bench's own, inserted
with expiries in 2001; a database holding someone else's unpaid order due by then makes the
bench skip those two figures rather than close it. (The close-lag scheduler also takes its
lease under the bench's prefix and skips its startup reconcile, which would otherwise index
every unpaid order of the database under that prefix.) Everything is deleted at the end
(``order_events`` rows go by the cascade), also when the bench fails or is interrupted. The
only other trace is planner statistics: the sweep figure runs ``ANALYZE`` (PostgreSQL:
``VACUUM (ANALYZE)``) on ``orders`` after each bulk load.

The report's JSON shape is documented in README.md. The package, one job a module:
``measure`` (runs on threads or tasks, percentiles, sizes), ``concurrency`` (thread and task
counts, the report's parts by count), ``loop`` (the async variants' event loop),
``workload`` (the bench's namespace, rows, cleanup and machine block), ``driver`` (the raw
DBAPI floors), ``variants``, ``throughput``, ``callers`` and ``figures`` (what is timed),
``holds`` and ``waiting`` (the issue 43 and 44 figures), ``verdicts`` (a target's pass or
miss), ``report`` (the report and its targets), ``tables`` (printing it), ``compare`` (saved
reports, side by side), ``plot`` (matplotlib), ``threads`` (what a figure left running) and
``cli`` (the command). Beside them, the scripts of the published runs: ``bench_durable``
(the lab on durable stores), ``bench_table`` (its tables), ``bench_combined``,
``profile_create``, ``profile_holds`` and ``profile_shares`` (flame graphs and their
shares), ``prune_bench`` and ``pg_capacity``.
"""

from benchmarks.figures import FIGURES

__all__ = ["FIGURES"]
