"""A checkout process that stops for good between a create's Redis admission and its SQL insert.

Started by the crash tests as ``python -m tests.support.workers.crash MARKER_DIR
CREATES_JSON`` with the repository root as its working directory and the test's stores in
``ORDERS_DATABASE_URL`` and ``ORDERS_REDIS_URL``. It runs on the system clock, like a real
checkout process.

``CREATES_JSON`` is a list of ``{"user": ..., "order_id": ..., "ttl_s": ..., "limit": ...}``;
each create runs in a thread of its own. A pausing index (tests/support/doubles.py), which
runs after the Redis admission and before the SQL insert, writes
``<MARKER_DIR>/<order_id>.admitted`` (atomically: written under another name, then renamed)
and then blocks forever, so the test knows every create is between its two steps and can
SIGKILL the process there. A create that
fails before reaching the hook writes ``<order_id>.error`` with its traceback instead.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from orders.bootstrap import build_service
from orders.config import Settings
from tests.support.doubles import pausing_after_admit


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    marker_dir = Path(argv[0])
    creates: list[dict[str, Any]] = json.loads(argv[1])
    forever = threading.Event()

    def hang_after_admit(user_id: str, order_id: str) -> None:
        _write_atomically(marker_dir / f"{order_id}.admitted", user_id)
        forever.wait()  # never set: the test kills the process here

    service = pausing_after_admit(build_service(Settings.from_env()), hang_after_admit)

    def create(spec: dict[str, Any]) -> None:
        try:
            service.create_unpaid_order(
                spec["user"], order_id=spec["order_id"], ttl_s=spec["ttl_s"], limit=spec["limit"]
            )
        except BaseException:
            _write_atomically(marker_dir / f"{spec['order_id']}.error", traceback.format_exc())
            raise
        _write_atomically(marker_dir / f"{spec['order_id']}.error", "the create returned")

    threads = [threading.Thread(target=create, args=(spec,), daemon=True) for spec in creates]
    for thread in threads:
        thread.start()
    forever.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
