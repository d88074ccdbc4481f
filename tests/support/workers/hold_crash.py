"""A process that stops for good at a named point of a create, payment or sweep of orders
with holds (issue 43), so the crash tests can SIGKILL it there.

Started as ``python -m tests.support.workers.hold_crash MARKER MODE CONFIG_JSON`` from the
repository root, with the test's stores in ``ORDERS_DATABASE_URL`` and ``ORDERS_REDIS_URL``.
``CONFIG_JSON``: ``{"now_ms", "user_id", "order_id", "holds", "ttl_s"}``; the service runs
on a manual clock set to ``now_ms``. ``MODE``, and where it stops:

* ``create-reserved``: creates the order; stops after its Redis steps (the resources'
  reservation, then the user's admission) and before its SQL insert
  (:func:`tests.support.doubles.pausing_after_admit`);
* ``create-uncommitted``: creates it; stops in the engine's ``commit`` event of the
  transaction that inserted its holds, before the database's COMMIT (on PostgreSQL the
  resources' rows are locked by then);
* ``create-committed``: creates it; stops after the commit, when the first resource the
  index did not know is about to be rebuilt in Redis (SQL was read for it);
* ``pay-committed``: marks ``order_id`` paid; stops after the commit, before the index's
  ``sell``;
* ``sweep-committed``: sweeps the orders due at ``now_ms``; stops after the first batch's
  commit, before the index's ``release_many`` of the units it released.

The Redis stops are a :class:`~orders.index.resources.ResourceIndex` subclass given to the
service's :class:`~orders.rules.holding.Holding` (composition, as ``PausingIndex``). At the
stop it writes MARKER (atomically) and blocks forever. Anything that fails before writes
``MARKER.error`` with the traceback; a call that returns writes it too.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import event

from orders.bootstrap import build_service
from orders.config import Settings
from orders.index.resources import ResourceIndex
from orders.service import OrderService
from orders.sql.inventory_tables import holds_table
from tests.support.clocks import ManualClock
from tests.support.doubles import pausing_after_admit


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


class StoppingResourceIndex(ResourceIndex):
    """The real resources' index that calls ``stop()`` before the write named ``at``."""

    def __init__(self, base: ResourceIndex, at: str, stop: Callable[[], None]) -> None:
        super().__init__(base.client, base.key_prefix)
        self.at = at
        self.stop = stop

    def sell(self, order_id: str, resource_ids: Sequence[str]) -> None:
        if self.at == "sell":
            self.stop()
        super().sell(order_id, resource_ids)

    def release_many(self, pairs: Iterable[tuple[str, Sequence[str]]]) -> None:
        if self.at == "release_many":
            self.stop()
        super().release_many(pairs)

    def rebuild(
        self,
        resource_id: str,
        capacity: int,
        sold: int,
        held: Sequence[tuple[str, int, int]],
        now_ms: int,
        named: Sequence[tuple[str, str, str | None]] = (),
    ) -> None:
        if self.at == "rebuild":
            self.stop()
        super().rebuild(resource_id, capacity, sold, held, now_ms, named)


#: The index write each mode stops before.
INDEX_STOPS = {
    "create-committed": "rebuild",
    "pay-committed": "sell",
    "sweep-committed": "release_many",
}


def stop_before_commit_of_holds(service: OrderService, stop: Callable[[], None]) -> None:
    """Call ``stop()`` in the ``commit`` event of the first transaction that inserted holds."""
    inserted = threading.local()
    prefix = f"INSERT INTO {holds_table.name} "

    def after(conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement.lstrip().startswith(prefix):
            inserted.conn = conn

    def on_commit(conn: Any) -> None:
        if getattr(inserted, "conn", None) is conn:
            stop()

    event.listen(service.engine, "after_cursor_execute", after)
    event.listen(service.engine, "commit", on_commit)


def main(argv: list[str]) -> int:
    marker, mode, config = Path(argv[0]), argv[1], json.loads(argv[2])
    forever = threading.Event()

    def stop() -> None:
        _write_atomically(marker, mode)
        forever.wait()  # never set: the test kills the process here

    clock = ManualClock(config["now_ms"])
    service = build_service(Settings.from_env(), clock=clock)
    if mode == "create-reserved":
        service = pausing_after_admit(service, lambda _user, _order: stop())
    elif mode == "create-uncommitted":
        stop_before_commit_of_holds(service, stop)
    else:
        service.holding.index = StoppingResourceIndex(
            service.resource_index, INDEX_STOPS[mode], stop
        )
    try:
        if mode.startswith("create-"):
            service.create_unpaid_order(
                config["user_id"],
                order_id=config["order_id"],
                ttl_s=config["ttl_s"],
                holds=config["holds"],
            )
        elif mode == "pay-committed":
            service.mark_paid(config["order_id"], payment_ref="crash-pay-1")
        elif mode == "sweep-committed":
            service.sweep_expired()
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except BaseException:
        _write_atomically(marker.with_name(marker.name + ".error"), traceback.format_exc())
        raise
    _write_atomically(marker.with_name(marker.name + ".error"), f"{mode}: the call returned")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
