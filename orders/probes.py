"""Whether a service's stores answer, for readiness probes: the scheduler's ``/readyz`` and
that of the operator pages without a scheduler (``orders dashboard``, a host application).

A store answers when a ``SELECT 1`` on the engine and a Redis ``PING`` come back within
:data:`READY_TIMEOUT_S`. The checks run side by side in threads of their own, so a store
that hangs costs the probe the timeout once, not once per store; each check's answer is
``ok``, ``down: <exception class>`` (never its message, which may carry a URL) or
``timeout``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from orders.service import OrderService

#: How long a readiness probe waits for each store's answer.
READY_TIMEOUT_S = 2.0


def run_checks(checks: dict[str, Callable[[], None]], timeout_s: float) -> dict[str, str]:
    """Run every check at once; at most ``timeout_s`` in all. A store that hangs leaves a
    daemon thread behind, which ends when its call does."""
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
        thread.join(timeout_s)  # they run side by side: the joins add up to timeout_s at most
    return {name: found.get(name, "timeout") for name in checks}


def store_checks(service: OrderService, timeout_s: float = READY_TIMEOUT_S) -> dict[str, str]:
    """``{"sql": ..., "redis": ...}``: each store's answer (see the module's docstring)."""

    def sql() -> None:
        with service.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def redis() -> None:
        service.index.client.ping()

    return run_checks({"sql": sql, "redis": redis}, timeout_s)


def all_ok(checks: dict[str, str]) -> bool:
    return all(answer == "ok" for answer in checks.values())


class StoreHealth:
    """``/healthz`` and ``/readyz`` of a process that runs no scheduler (a host app).

    ``/healthz`` is 200 whenever the process answers: a store outage is not a reason to
    restart it. ``/readyz`` is 200 when both stores answer, else 503 naming the one that
    did not. Neither needs a token: the answers hold no order data, URL or secret.
    """

    def __init__(self, service: OrderService) -> None:
        self.service = service

    def healthz(self) -> tuple[int, dict[str, Any]]:
        return 200, {"status": "ok"}

    def readyz(self) -> tuple[int, dict[str, Any]]:
        checks = store_checks(self.service)
        ok = all_ok(checks)
        return 200 if ok else 503, {"status": "ok" if ok else "failing", "checks": checks}
