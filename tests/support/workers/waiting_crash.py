"""A process that sweeps an expired order holding named units while a waiting-list entry
waits for them (issue 44), and stops for good at a named point between the close and the
entry's offer, or inside the offer, so the crash tests can SIGKILL it there.

Started as ``python -m tests.support.workers.waiting_crash MARKER MODE CONFIG_JSON`` from
the repository root, with the test's stores in ``ORDERS_DATABASE_URL`` and
``ORDERS_REDIS_URL``. ``CONFIG_JSON``: ``{"now_ms"}``; the service runs on a manual clock
set to ``now_ms`` and sweeps the orders due then. ``MODE``, and where it stops:

* ``sweep-closed``: after the sweep batch's commit and its Redis release, when the batch
  hands the resources it released to the serving threads (``Sweep.freed``): nothing of the
  waiting list served yet;
* ``offer-admitted``: in a serving thread, in the create of an entry's order
  ``waiting-<id>``, after its Redis steps (the resources' reservation, then the user's
  admission) and before its SQL insert (:func:`tests.support.doubles.pausing_after_admit`);
* ``offer-uncommitted``: in that create, in the engine's ``commit`` event of the
  transaction that inserted its holds, before the database's COMMIT (on PostgreSQL its
  units' rows are locked by then);
* ``offer-committed``: after that create committed (and wrote Redis), when the entry is
  about to be marked served (``WaitingRecords.mark_served``).

The stops wrap the service's own parts from the outside (nothing of ``orders`` is edited):
the sweep's ``freed`` callable, the waiting list's records' ``mark_served``, the admission
index (``PausingIndex``) and an engine event. At the stop the worker writes MARKER
(atomically) and blocks forever. Anything that fails before writes ``MARKER.error`` with
the traceback; a sweep whose serving ends without reaching the stop writes it too.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from orders.bootstrap import build_service
from orders.config import Settings
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.doubles import pausing_after_admit
from tests.support.workers.hold_crash import stop_before_commit_of_holds

#: How long the worker lets the serving threads run before it reports that no stop came.
SERVING_TIMEOUT_S = 60.0
#: The prefix of every order id a waiting-list entry is served with (``waiting-<id>``).
OFFER_PREFIX = "waiting-"


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def stopping(service: OrderService, mode: str, stop: Callable[[], None]) -> OrderService:
    """The service whose sweep stops at ``mode``'s point (the module docstring)."""
    if mode == "sweep-closed":
        service.sweep.freed = lambda _resource_ids: stop()
    elif mode == "offer-admitted":
        service = pausing_after_admit(
            service, lambda _user, order_id: stop() if order_id.startswith(OFFER_PREFIX) else None
        )
    elif mode == "offer-uncommitted":
        stop_before_commit_of_holds(service, stop)
    elif mode == "offer-committed":
        records = service.waiting_list.records
        mark_served = records.mark_served

        def stop_before_mark(entry_id: int, order_id: str, now_ms: int) -> bool:
            stop()
            return mark_served(entry_id, order_id, now_ms)

        records.mark_served = stop_before_mark  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return service


def main(argv: list[str]) -> int:
    marker, mode, config = Path(argv[0]), argv[1], json.loads(argv[2])
    forever = threading.Event()

    def stop() -> None:
        _write_atomically(marker, mode)
        forever.wait()  # never set: the test kills the process here

    try:
        base = build_service(Settings.from_env(), clock=ManualClock(config["now_ms"]))
        service = stopping(base, mode, stop)
        service.sweep_expired()
        # The offers run on the serving threads: a stop there blocks this wait too.
        served = service.serving.drain(SERVING_TIMEOUT_S)
    except BaseException:
        _write_atomically(marker.with_name(marker.name + ".error"), traceback.format_exc())
        raise
    outcome = "served without reaching the stop" if served else "serving timed out"
    _write_atomically(marker.with_name(marker.name + ".error"), f"{mode}: {outcome}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
