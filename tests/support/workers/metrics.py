"""A host process and its workers in Prometheus multiprocess mode, for
``tests/integration/test_metrics_multiprocess.py``.

``python -m tests.support.workers.metrics`` (``PROMETHEUS_MULTIPROC_DIR`` set to an empty folder)
starts ``WORKERS`` spawned children one after the other, each counting creates, observing a
close lag and setting one gauge per multiprocess mode to its value in ``GAUGE_VALUES``.
Then it prints one JSON line: the children's pids, and the exposition of
``orders.metrics`` before and after the last child is marked dead. It runs apart from
pytest because prometheus-client picks its value class, in memory or in files, once, when
it is first imported.
"""

from __future__ import annotations

import json
import multiprocessing

#: The modes a gauge of orders may sensibly use, and ``all`` (one series per process).
GAUGE_MODES = ("livemax", "max", "livemostrecent", "mostrecent", "livesum", "all")
#: Child i sets every gauge to GAUGE_VALUES[i]; the largest is the last, as is the newest.
GAUGE_VALUES = (5.0, 2.0, 9.0)
WORKERS = len(GAUGE_VALUES)


def work(index: int) -> None:
    """One worker: what it counts lands in its own files of the folder."""
    from prometheus_client import Gauge  # noqa: PLC0415

    from orders import metrics  # noqa: PLC0415

    metrics.CREATES.labels("admitted").inc(index + 1)
    metrics.CREATES.labels("refused_redis").inc(10)
    metrics.CLOSE_LAG_SECONDS.observe(0.01)
    for mode in GAUGE_MODES:
        gauge = Gauge(f"probe_{mode}", f"set by every worker, {mode}", multiprocess_mode=mode)
        gauge.set(GAUGE_VALUES[index])


def main() -> None:
    from orders import metrics  # noqa: PLC0415

    spawn = multiprocessing.get_context("spawn")
    pids = []
    for index in range(WORKERS):  # one after the other: "most recent" is the last one
        child = spawn.Process(target=work, args=(index,))
        child.start()
        child.join(30)
        assert child.exitcode == 0, child.exitcode
        pids.append(child.pid)
    before = metrics.exposition()[0].decode()
    metrics.mark_process_dead(pids[-1])
    after = metrics.exposition()[0].decode()
    print(json.dumps({"pids": pids, "before": before, "after": after}))


if __name__ == "__main__":
    main()
