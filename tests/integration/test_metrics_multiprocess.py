"""Prometheus multiprocess mode: what ``orders.metrics`` shows for several worker processes,
and the settings it refuses.

Each check runs in a fresh interpreter: prometheus-client reads ``PROMETHEUS_MULTIPROC_DIR``
once, at its import, and this test process imported it long ago.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import child_env, run_python
from tests.support.workers.metrics import GAUGE_MODES, GAUGE_VALUES

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no {name}{labels} among {sorted({n for n, _ in samples})}"
    return samples[key]


def run_workers(folder: Path) -> dict[str, Any]:
    done = run_python(
        "-m", "tests.support.workers.metrics", env=child_env(PROMETHEUS_MULTIPROC_DIR=str(folder))
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_counters_are_summed_and_each_gauge_combined_by_its_mode_over_worker_processes(
    tmp_path: Path,
) -> None:
    result = run_workers(tmp_path)
    pids: list[int] = result["pids"]
    assert len(set(pids)) == len(GAUGE_VALUES)
    before, after = parse(result["before"]), parse(result["after"])

    for samples in (before, after):  # what a worker counted stays counted after it exits
        assert value(samples, "orders_creates_total", result="admitted") == 1 + 2 + 3
        assert value(samples, "orders_creates_total", result="refused_redis") == 30
        assert value(samples, "orders_close_lag_seconds_count") == 3
        assert value(samples, "orders_close_lag_seconds_bucket", le="0.01") == 3
        # "all": one series per process, the pid as a label, dead or alive.
        assert {
            int(pid): v
            for (name, labels), v in samples.items()
            if name == "probe_all"
            for key, pid in labels
            if key == "pid"
        } == dict(zip(pids, GAUGE_VALUES, strict=True))
    # Every worker alive (its files there): the largest, the last set, the sum.
    combined = {mode: value(before, f"probe_{mode}") for mode in GAUGE_MODES if mode != "all"}
    assert combined == {
        "livemax": 9,
        "max": 9,
        "livemostrecent": 9,
        "mostrecent": 9,
        "livesum": 5 + 2 + 9,
    }
    # The last worker marked dead: the live* modes forget it, the others keep it.
    combined = {mode: value(after, f"probe_{mode}") for mode in GAUGE_MODES if mode != "all"}
    assert combined == {"livemax": 5, "max": 9, "livemostrecent": 2, "mostrecent": 9, "livesum": 7}


# Imports prometheus-client with the environment it starts with, then tries each setting
# of argv[1] in turn: the field and problem of the InvalidInput register() raised, or null.
PROBE = """
import json, os, sys
import prometheus_client
from orders import metrics
from orders.errors import InvalidInput
outcomes = []
for name, folder in json.loads(sys.argv[1]):
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    os.environ.pop("prometheus_multiproc_dir", None)
    os.environ[name] = folder
    try:
        metrics.register()
        outcomes.append(None)
    except InvalidInput as exc:
        outcomes.append([exc.field, exc.problem])
print(json.dumps(outcomes))
"""


def try_settings(settings: list[tuple[str, str]], **env: str) -> list[list[str] | None]:
    done = run_python("-c", PROBE, json.dumps(settings), env=child_env(**env))
    assert done.returncode == 0, done.stderr
    outcomes: list[list[str] | None] = json.loads(done.stdout)
    return outcomes


def test_a_wrong_multiprocess_folder_is_invalid_input_at_register(tmp_path: Path) -> None:
    missing, good = str(tmp_path / "missing"), str(tmp_path)
    field = "PROMETHEUS_MULTIPROC_DIR"
    # A worker started with a folder that is not there: refused before a metric is defined
    # (prometheus-client itself would fail in the first inc() or labels()); so is the
    # variable removed later (NOTHING is another variable); once the folder exists,
    # registering works.
    assert try_settings(
        [(field, missing), ("NOTHING", ""), (field, good)], PROMETHEUS_MULTIPROC_DIR=missing
    ) == [
        [field, "not an existing directory"],
        [field, "removed after prometheus_client was imported"],
        None,
    ]
    # Imported without it: every later setting is refused, with what is wrong.
    (tmp_path / "a-file").touch()
    assert try_settings(
        [
            (field, ""),
            (field, str(tmp_path / "a-file")),
            ("prometheus_multiproc_dir", good),
            (field, good),
        ]
    ) == [
        [field, "set but empty"],
        [field, "not an existing directory"],
        [field, "unset, but the old prometheus_multiproc_dir is set"],
        [field, "set after prometheus_client was imported: set it before start"],
    ]
