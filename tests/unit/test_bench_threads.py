"""The bench's check that a figure leaves no thread running (benchmarks.threads)."""

from __future__ import annotations

import threading

from benchmarks import threads


def test_a_thread_started_since_the_snapshot_and_still_running_is_named() -> None:
    before = threads.running()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="left-by-a-figure", daemon=True)
    worker.start()
    try:
        assert threads.left_behind(before, timeout_s=0.05) == ["left-by-a-figure"]
    finally:
        stop.set()
        worker.join()


def test_a_thread_that_ends_within_the_wait_is_not_left_behind() -> None:
    before = threads.running()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="ending", daemon=True)
    worker.start()
    threading.Timer(0.05, stop.set).start()
    assert threads.left_behind(before, timeout_s=5.0) == []
    assert not worker.is_alive()


def test_threads_alive_before_the_figure_are_not_its_own() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="the-host-s", daemon=True)
    worker.start()
    try:
        assert threads.left_behind(threads.running(), timeout_s=0.05) == []
    finally:
        stop.set()
        worker.join()
