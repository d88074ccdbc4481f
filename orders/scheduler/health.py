"""The scheduler's health endpoints: ``/healthz`` (alive) and ``/readyz`` (its stores answer).

``orders scheduler --health-port`` serves them for probes (a Kubernetes liveness and
readiness probe, a load balancer, a person with curl). The two answer different questions,
so a store outage never gets a healthy process restarted:

* ``/healthz`` is 200 while the scheduler runs and its sweep job shows signs of life: a tick
  or a sweep's batch started within ``max(3 * cadence_s, lease_ttl_s)``. Ticks come at
  least every cadence, and a sweep renews its lease between batches, so a longer silence
  means the job is stuck (and its lease is lapsing anyway). A store outage does not make it
  fail: the ticks go on, and fail fast.
* ``/readyz`` is 200 when a ``SELECT 1`` on the engine and a Redis ``PING`` both answer
  within ``READY_TIMEOUT_S``; 503 names the store that did not (never a URL).

Both answer JSON with the scheduler's role (active: it holds the lease; standby), its owner
token, its last successful sweep and its lease expiry, and the checks made. The server is
bound before the scheduler starts (a taken port is an error at once) and answers 503
``starting`` until :meth:`HealthServer.attach` hands it the sweeper and its scheduler.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import text

from orders.httpd import QuietHandler, Served, send_json, serve
from orders.scheduler.sweeper import Sweeper

#: How long /readyz waits for each store's answer.
READY_TIMEOUT_S = 2.0
#: A sweep job silent for this many cadences (and at least one lease TTL) is wedged.
WEDGED_AFTER_CADENCES = 3


class HealthServer:
    """A bound health server; :meth:`attach` tells it what to report on."""

    def __init__(self, host: str, port: int) -> None:
        self._sweeper: Sweeper | None = None
        self._scheduler: Any = None
        handler = type("HealthHandler", (_HealthHandler,), {"health": self})
        self.served: Served = serve(handler, host, port, name="orders-health", field="health_port")
        self._closed = False

    @property
    def url(self) -> str:
        return self.served.url

    def attach(self, sweeper: Sweeper, scheduler: Any) -> None:
        """Report on ``sweeper`` and its APScheduler ``scheduler`` from now on."""
        self._scheduler = scheduler
        self._sweeper = sweeper

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if not self._closed:
            self._closed = True
            self.served.close()

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
        service = sweeper.service

        def sql() -> None:
            with service.engine.connect() as conn:
                conn.execute(text("SELECT 1"))

        def redis() -> None:
            service.index.client.ping()

        checks = _run_checks({"sql": sql, "redis": redis}, READY_TIMEOUT_S)
        return _answer(sweeper, checks, ok=all(v == "ok" for v in checks.values()))


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


def _run_checks(checks: dict[str, Any], timeout_s: float) -> dict[str, str]:
    """Run each check in a thread of its own, all at once; each answers "ok", "down:
    <exception class>" or "timeout" (a store that hangs leaves a daemon thread behind,
    which ends when its call does)."""
    found: dict[str, str] = {}

    def run(name: str) -> None:
        try:
            checks[name]()
        except Exception as exc:  # any failure is the answer; only its class is shown
            found[name] = f"down: {type(exc).__name__}"
        else:
            found[name] = "ok"

    threads = {
        name: threading.Thread(target=run, args=(name,), name=f"orders-ready-{name}", daemon=True)
        for name in checks
    }
    for thread in threads.values():
        thread.start()
    for thread in threads.values():
        thread.join(timeout_s)  # at most timeout_s in all: they run side by side
    return {name: found.get(name, "timeout") for name in checks}


class _HealthHandler(QuietHandler):
    health: ClassVar[HealthServer]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            send_json(self, *self.health.healthz())
        elif path == "/readyz":
            send_json(self, *self.health.readyz())
        else:
            send_json(self, 404, {"error": "not found", "paths": ["/healthz", "/readyz"]})

    do_HEAD = do_GET
