"""The scheduler's health endpoints: ``/healthz`` (alive) and ``/readyz`` (its stores answer).

``orders scheduler --health-port`` serves them for probes (a Kubernetes liveness and
readiness probe, a load balancer, a person with curl). The two answer different questions,
so a store outage never gets a healthy process restarted:

* ``/healthz`` is 200 while the scheduler runs and its sweep job shows signs of life: a tick
  or a sweep's batch started within ``max(3 * cadence_s, lease_ttl_s)``. Ticks come at
  least every cadence, and a sweep renews its lease between batches, so a longer silence
  means the job is stuck (and its lease is lapsing anyway). A store outage does not make it
  fail: the ticks go on, and fail fast.
* ``/readyz`` is 200 when both stores answer (:func:`orders.probes.store_checks`); 503
  names the store that did not (never a URL).

Both answer JSON with the scheduler's role (active: it holds the lease; standby), its owner
token, its last successful sweep and its lease expiry, and the checks made. They answer 503
``starting`` until :meth:`SchedulerHealth.attach` hands them the sweeper and its
scheduler. :class:`HealthServer` serves them on a port of their own, bound before the
scheduler starts (a taken port is an error at once); ``orders scheduler --ops-port`` puts
:meth:`SchedulerHealth.route` beside the metrics and the dashboard instead.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from orders.httpd import Request, Response, Served, first_of, json_response, serve
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

    def close(self) -> None:
        """Nothing to stop: the server that carries the routes is closed by its owner."""

    def route(self, request: Request) -> Response | None:
        """``/healthz`` and ``/readyz`` (GET or HEAD); None for anything else."""
        if request.method not in ("GET", "HEAD"):
            return None
        if request.path == "/healthz":
            return json_response(*self.healthz())
        if request.path == "/readyz":
            return json_response(*self.readyz())
        return None

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


class HealthServer(SchedulerHealth):
    """The probes on a port of their own, bound at once."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        app = first_of(self.route)
        self.served: Served = serve(app, host, port, name="orders-health", field="health_port")
        self._closed = False

    @property
    def url(self) -> str:
        return self.served.url

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if not self._closed:
            self._closed = True
            self.served.close()


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
