"""The scheduler's health endpoints: ``/healthz`` (alive) and ``/readyz`` (its stores answer).

``orders scheduler --ops-port`` serves them for probes (a Kubernetes liveness and readiness
probe, a load balancer, a person with curl), beside the metrics and the dashboard. The two
answer different questions, so a store outage never gets a healthy process restarted:

* ``/healthz`` is 200 while the scheduler runs and its sweep job shows signs of life: a tick
  or a sweep's batch started within ``max(3 * cadence_s, lease_ttl_s)``. Ticks come at
  least every cadence, and a sweep renews its lease between batches, so a longer silence
  means the job is stuck (and its lease is lapsing anyway). A store outage does not make it
  fail: the ticks go on, and fail fast.
* ``/readyz`` is 200 when both stores answer (:func:`orders.probes.store_checks`); 503
  names the store that did not (never a URL).

Both answer JSON with the scheduler's role (active: it holds the lease; standby), its owner
token, its last successful sweep and its lease expiry, and the checks made. They answer 503
``starting`` until :meth:`SchedulerHealth.attach` hands them the sweeper and its scheduler.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from orders.probes import all_ok, store_checks
from orders.scheduler.sweeper import Sweeper

#: A sweep job silent for this many cadences (and at least one lease TTL) is wedged.
WEDGED_AFTER_CADENCES = 3


class SchedulerHealth:
    """The two probes of one scheduler; :meth:`attach` tells them what to report on."""

    def __init__(self) -> None:
        self._sweeper: Sweeper | None = None
        self._scheduler: Any = None

    def attach(self, sweeper: Sweeper, scheduler: Any) -> None:
        """Report on ``sweeper`` and its APScheduler ``scheduler`` from now on."""
        self._scheduler = scheduler
        self._sweeper = sweeper

    def healthz(self) -> tuple[int, dict[str, Any]]:
        sweeper = self._sweeper
        if sweeper is None:
            return 503, {"status": "failing", "checks": {"scheduler": "starting"}}
        running = self._scheduler.running and not sweeper.stopping
        scheduler = "running" if running else "stopping"
        limit_s = max(WEDGED_AFTER_CADENCES * sweeper.cadence_s, sweeper.lease_ttl_s)
        silent_s = sweeper.status.silent_s()
        checks = {
            "scheduler": scheduler,
            "sweep_job": "ok" if silent_s <= limit_s else "wedged",
            "sweep_job_silent_s": round(silent_s, 3),
        }
        return _answer(sweeper, checks, ok=scheduler == "running" and silent_s <= limit_s)

    def readyz(self) -> tuple[int, dict[str, Any]]:
        sweeper = self._sweeper
        if sweeper is None:
            return 503, {"status": "failing", "checks": {"scheduler": "starting"}}
        checks = store_checks(sweeper.service)
        return _answer(sweeper, checks, ok=all_ok(checks))


def _answer(sweeper: Sweeper, checks: dict[str, Any], *, ok: bool) -> tuple[int, dict[str, Any]]:
    last_sweep_ms, lease_expires_ms = sweeper.last_sweep_ms, sweeper.lease_expires_ms
    return 200 if ok else 503, {
        "status": "ok" if ok else "failing",
        "role": "active" if sweeper.holds_lease else "standby",
        "owner": sweeper.owner,
        "last_successful_sweep": _iso(last_sweep_ms),
        "last_successful_sweep_ms": last_sweep_ms,
        "lease_expires": _iso(lease_expires_ms),
        "lease_expires_ms": lease_expires_ms,
        "checks": checks,
    }


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
