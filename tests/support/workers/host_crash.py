"""A host process that stops for good at the end of its own transaction, around the
service's Redis follow-up, so the test can SIGKILL it there.

Started by the crash tests as ``python -m tests.support.workers.host_crash MARKER MODE
ORDER_ID USER_ID`` from the repository root, with the test's
stores in ``ORDERS_DATABASE_URL`` and ``ORDERS_REDIS_URL``; on the system clock, like a
real checkout. ``MODE``:

* ``pay``: marks ORDER_ID paid in a host transaction and commits; the stop is a commit
  listener of the host's, heard after the service's (which has sent the Redis follow-up)
  and before the database's COMMIT;
* ``pay-first``: the same, with the host's listener heard before the service's;
* ``create-rollback``: creates ORDER_ID for USER_ID in a host transaction and rolls it
  back; the stop is a rollback listener heard before the service's compensation;
* ``create-commit``: creates it and commits; the stop is after the service's listener,
  before the COMMIT.

At the stop it writes MARKER (atomically) and blocks forever. Anything that fails before
writes ``MARKER.error`` with the traceback.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from sqlalchemy import event

from orders.bootstrap import build_service
from orders.config import Settings
from orders.sql import host


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    marker, mode, order_id, user_id = Path(argv[0]), argv[1], argv[2], argv[3]
    forever = threading.Event()
    service = build_service(Settings.from_env())
    engine = service.engine

    def stop_here(*_args: Any) -> None:
        _write_atomically(marker, mode)
        forever.wait()  # never set: the test kills the process here

    hook = "rollback" if mode == "create-rollback" else "commit"
    if mode in ("pay-first", "create-rollback"):
        event.listen(engine, hook, stop_here)  # heard before the service's listeners
        host.listen(engine)
    else:
        host.listen(engine)
        event.listen(engine, hook, stop_here)
    try:
        with engine.connect() as conn:
            if mode.startswith("pay"):
                service.mark_paid(order_id, payment_ref="crash-1", connection=conn)
            else:
                service.create_unpaid_order(user_id, order_id=order_id, connection=conn)
            if mode == "create-rollback":
                conn.rollback()
            else:
                conn.commit()
    except BaseException:
        _write_atomically(marker.with_name(marker.name + ".error"), traceback.format_exc())
        raise
    _write_atomically(marker.with_name(marker.name + ".error"), "the transaction ended")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
