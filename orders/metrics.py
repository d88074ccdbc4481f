"""Prometheus metrics of the expiry pipeline (prometheus-client, default registry).

They live in the process's default registry, so a host application that already serves
``/metrics`` exposes them with its own; the operator pages (``orders.dashboard``) serve
:func:`exposition` at theirs. This module imports nothing else from the package but
``orders.errors``, so any module may count.

prometheus-client is imported, and the metrics registered, when one of them is first used
(``metrics.CREATES``...) or by :func:`register`: a command that counts nothing, such as
``orders show``, does not pay for it. A host application that wants the metrics listed
before the service first counts calls :func:`register` at start.

Several worker processes (gunicorn, ``uvicorn --workers``) each count in their own memory,
so a scrape would see whichever worker answered. With ``PROMETHEUS_MULTIPROC_DIR`` set
before the workers start, prometheus-client writes each process's values to files in that
folder instead, and :func:`registry` (what :func:`exposition` shows) reads them all:
counters and histograms summed, each gauge combined as its ``multiprocess_mode`` says.
:func:`mark_process_dead` drops a dead worker's ``live*`` gauges.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orders.errors import InvalidInput

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    CREATES: Counter
    PAYMENTS: Counter
    CANCELS: Counter
    REPLACED: Counter
    EXTENSIONS: Counter
    CLOSES: Counter
    REMINDERS: Counter
    PAID_AFTER_REMINDER: Counter
    SWEEP_SECONDS: Histogram
    CLOSE_LAG_SECONDS: Histogram
    BACKLOG: Gauge
    RECONCILE_FIXES: Counter
    FOREIGN_KEYS: Counter
    STORE_ERRORS: Counter
    SCHEDULER_ACTIVE: Gauge
    LAST_SWEEP_TIMESTAMP: Gauge
    OLDEST_OVERDUE_SECONDS: Gauge
    JOB_FAILURES: Counter
    PARKED_EVENTS: Gauge
    PAUSE_STARTED_TIMESTAMP: Gauge
    COMBINED_BATCH_SIZE: Histogram
    HOLDS: Counter
    RESOURCE_DRIFT: Counter
    WAITING: Counter

#: Every metric this module defines, by the name it is read as (``metrics.CREATES``).
METRIC_NAMES = frozenset(
    {
        "CREATES",
        "PAYMENTS",
        "CANCELS",
        "REPLACED",
        "EXTENSIONS",
        "CLOSES",
        "REMINDERS",
        "PAID_AFTER_REMINDER",
        "SWEEP_SECONDS",
        "CLOSE_LAG_SECONDS",
        "BACKLOG",
        "RECONCILE_FIXES",
        "FOREIGN_KEYS",
        "STORE_ERRORS",
        "SCHEDULER_ACTIVE",
        "LAST_SWEEP_TIMESTAMP",
        "OLDEST_OVERDUE_SECONDS",
        "JOB_FAILURES",
        "PARKED_EVENTS",
        "PAUSE_STARTED_TIMESTAMP",
        "COMBINED_BATCH_SIZE",
        "HOLDS",
        "RESOURCE_DRIFT",
        "WAITING",
    }
)

#: The ``outcome`` label values of ``orders_holds_total``: holds taken by a create, refused
#: (by reason, :class:`~orders.errors.HoldRefused`), released by a close or cancel, sold.
HOLD_OUTCOMES = (
    "taken",
    "refused_sold_out",
    "refused_user_cap",
    "refused_unknown_resource",
    "released",
    "sold",
)
#: The ``kind`` label values of ``orders_resource_drift_total``: the Redis copy of a
#: resource was missing, or stale (other than SQL).
DRIFT_KINDS = ("missing", "stale")
#: The ``outcome`` label values of ``orders_waiting_total``: waiting-list entries added,
#: served (an order made for them), left, expired (past their ``until``).
WAITING_OUTCOMES = ("added", "served", "left", "expired")

_registering = threading.Lock()
_defined: dict[str, Any] = {}


def _define() -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram  # noqa: PLC0415

    return {
        "CREATES": Counter(
            "orders_creates_total",
            "create_unpaid_order calls by result",
            # admitted, retry (same order again), refused_redis, refused_sql, refused_rate
            # (the create rate), conflict
            ["result"],
        ),
        "PAYMENTS": Counter(
            "orders_payments_total",
            "mark_paid calls by outcome",
            # on_time, late_before_close (after expires_at, before the sweep), late_accepted
            # (closed -> paid in the late-payment window), refused_after_close,
            # refused_strict (strict_expiry), refused_late (the late-payment check said no),
            # refused_mismatch (amount or currency), repeat (idempotent retry), other_ref
            ["outcome"],
        ),
        "CANCELS": Counter("orders_cancels_total", "orders cancelled"),
        "REPLACED": Counter(
            "orders_replaced_total", "oldest unpaid orders cancelled to make room (on_limit)"
        ),
        "EXTENSIONS": Counter("orders_extensions_total", "expiries moved", ["trigger"]),
        "CLOSES": Counter("orders_closes_total", "orders closed by the sweep"),
        "REMINDERS": Counter("orders_reminders_total", "expiring events the sweep wrote"),
        "PAID_AFTER_REMINDER": Counter(
            "orders_paid_after_reminder_total", "payments of orders that had been reminded"
        ),
        "SWEEP_SECONDS": Histogram(
            "orders_sweep_duration_seconds",
            "duration of sweeps that closed something",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        ),
        "CLOSE_LAG_SECONDS": Histogram(
            "orders_close_lag_seconds",
            "closed_at - expires_at of each closed order",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        ),
        # multiprocess_mode only counts under PROMETHEUS_MULTIPROC_DIR: the active
        # scheduler's judgement, the newest of the live processes' values.
        "BACKLOG": Gauge(
            "orders_backlog",
            "unpaid orders due but not yet closed, after the last tick",
            multiprocess_mode="livemostrecent",
        ),
        "RECONCILE_FIXES": Counter(
            "orders_reconcile_fixes_total",
            "index members reconcile fixed, by kind",
            ["kind"],  # added, rescored, removed_terminal, removed_expired, removed_abandoned
        ),
        "FOREIGN_KEYS": Counter(
            "orders_foreign_keys_total",
            "keys or members under the key prefix that the service did not write, skipped",
        ),
        "STORE_ERRORS": Counter(
            "orders_store_errors_total", "failed Redis or SQL calls", ["store"]
        ),
        "SCHEDULER_ACTIVE": Gauge(
            "orders_scheduler_active",
            "1 while this process's sweeper holds the lease, else 0",
            multiprocess_mode="livemax",
        ),
        "LAST_SWEEP_TIMESTAMP": Gauge(
            "orders_last_successful_sweep_timestamp_seconds",
            "service-clock Unix time of this process's last sweep that ran to its end",
            multiprocess_mode="max",
        ),
        "OLDEST_OVERDUE_SECONDS": Gauge(
            "orders_oldest_overdue_unpaid_seconds",
            "how long the oldest unpaid order past its expiry has been due, after the last "
            "sweep (0: none)",
            multiprocess_mode="livemostrecent",
        ),
        "JOB_FAILURES": Counter(
            "orders_job_failures_total",
            "scheduler job runs that ended in an exception (APScheduler job error events)",
            # Not "job": Prometheus sets that label on every target (ours would come back
            # as exported_job).
            ["scheduler_job"],
        ),
        "PARKED_EVENTS": Gauge(
            "orders_parked_events",
            "events parked (out of retries) per consumer, after the last events job run",
            ["consumer"],
            multiprocess_mode="livemostrecent",
        ),
        "PAUSE_STARTED_TIMESTAMP": Gauge(
            "orders_pause_started_timestamp_seconds",
            "Unix time the open incident pause began (0: none), after the last tick",
            multiprocess_mode="livemostrecent",
        ),
        "COMBINED_BATCH_SIZE": Histogram(
            "orders_combined_batch_size",
            "calls per run of a combining queue (ORDERS_COMBINE_*): 1 for a call that ran "
            "alone, at once or after a wait",
            ["kind"],  # create, transition
            buckets=(1, 2, 4, 8, 16, 32, 64),
        ),
        # No resource label: resource ids are unbounded, and so would the series be.
        "HOLDS": Counter(
            "orders_holds_total",
            "holds of counted resources (one per order and resource), by outcome",
            ["outcome"],  # HOLD_OUTCOMES
        ),
        "RESOURCE_DRIFT": Counter(
            "orders_resource_drift_total",
            "resources whose Redis copy reconcile found wrong and rebuilt from SQL, by kind",
            ["kind"],  # DRIFT_KINDS
        ),
        "WAITING": Counter(
            "orders_waiting_total",
            "waiting-list entries, by outcome",
            ["outcome"],  # WAITING_OUTCOMES
        ),
    }


def register() -> None:
    """Import prometheus-client and register every metric in the default registry, once."""
    with _registering:
        if not _defined:
            multiprocess_dir()  # a wrong folder fails here, before any metric writes to it
            defined = _define()
            if defined.keys() != METRIC_NAMES:  # pragma: no cover - a slip when adding one
                raise RuntimeError("orders.metrics: METRIC_NAMES and _define() disagree")
            _defined.update(defined)
            globals().update(defined)  # later reads are plain attribute lookups


def __getattr__(name: str) -> Any:
    """The first read of a metric registers them all (PEP 562)."""
    if name not in METRIC_NAMES:
        raise AttributeError(f"module 'orders.metrics' has no attribute {name!r}")
    register()
    return _defined[name]


#: The variable prometheus-client reads, at its import, to write values to files.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> Path | None:
    """The folder of multiprocess mode, or None when ``PROMETHEUS_MULTIPROC_DIR`` is unset.

    Raises :class:`InvalidInput` (field ``PROMETHEUS_MULTIPROC_DIR``) for a setting that
    prometheus-client would otherwise take in silence or fail on deep inside a later
    ``inc()``: set but empty (it would write to the working directory), not a directory,
    not writable, only the deprecated lower-case name set, or set after prometheus-client
    was imported without it (this process then counts in memory, and the folder never
    sees its values).
    """
    from prometheus_client import values  # noqa: PLC0415

    raw = os.environ.get(MULTIPROC_ENV)
    if raw is None and "prometheus_multiproc_dir" in os.environ:
        raise InvalidInput(MULTIPROC_ENV, "unset, but the old prometheus_multiproc_dir is set")
    # The value class prometheus-client chose at its import, from the same variable: the
    # in-memory MutexValue, or one that counts in files.
    counts_in_files = values.ValueClass is not values.MutexValue
    if raw is None:
        if counts_in_files:
            raise InvalidInput(MULTIPROC_ENV, "removed after prometheus_client was imported")
        return None
    if not raw:
        raise InvalidInput(MULTIPROC_ENV, "set but empty")
    folder = Path(raw)
    if not folder.is_dir():
        raise InvalidInput(MULTIPROC_ENV, "not an existing directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInput(MULTIPROC_ENV, "not writable")
    if not counts_in_files:
        raise InvalidInput(
            MULTIPROC_ENV, "set after prometheus_client was imported: set it before start"
        )
    return folder


def registry() -> CollectorRegistry:
    """What ``/metrics`` shows: the default registry, or, in multiprocess mode, a fresh
    registry whose one collector sums the files of every process (prometheus-client's
    documented way: the default registry would show only this process's values)."""
    from prometheus_client import REGISTRY, CollectorRegistry  # noqa: PLC0415
    from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

    register()
    folder = multiprocess_dir()
    if folder is None:
        return REGISTRY
    combined = CollectorRegistry()
    MultiProcessCollector(combined, path=str(folder))  # type: ignore[no-untyped-call]
    return combined


def exposition() -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` answer from :func:`registry`, for a host
    application's own route."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # noqa: PLC0415

    return generate_latest(registry()), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    """Forget a dead worker's ``live*`` gauges (a no-op outside multiprocess mode).

    Call it from the process manager when a worker exits, e.g. gunicorn's ``child_exit``
    hook. Its counters stay: what it counted happened. Its non-live gauges stay too.
    """
    from prometheus_client import multiprocess  # noqa: PLC0415

    folder = multiprocess_dir()
    if folder is not None:
        multiprocess.mark_process_dead(pid, str(folder))  # type: ignore[no-untyped-call]
