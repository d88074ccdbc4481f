"""What a command loads before its first query: ``orders --help`` none of the heavy libraries,
``orders show`` only those it queries with.

Each command runs in a fresh interpreter (this test process has imported everything already)
that runs it as ``orders`` would, then reports which heavy packages ``sys.modules`` holds.
How long start-up takes is measured for benchmarks/README.md, never asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import Engine

from orders.sql import migrate
from tests.support.processes import child_env, run_orders, run_python

#: Libraries that cost tens to hundreds of milliseconds to import.
HEAVY = ("sqlalchemy", "redis", "apscheduler", "rich", "prometheus_client", "alembic", "uvicorn")

# Runs ``orders ARGS`` in this interpreter, then prints one JSON line: the exit status and
# the heavy packages (and their submodules) that were imported.
PROBE = """
import json, sys
from orders.cli import main
try:
    main(sys.argv[1:], prog_name="orders")
    code = 0
except SystemExit as exit:
    code = exit.code or 0
heavy = {heavy!r}
loaded = sorted({{h for h in heavy for m in sys.modules if m == h or m.startswith(h + ".")}})
print(json.dumps({{"code": code, "loaded": loaded}}))
"""


def run_probe(*args: str, env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """``orders ARGS`` in a child: its output before the report, and the report."""
    done = run_python("-c", PROBE.format(heavy=HEAVY), *args, env=env)
    output, _, report = done.stdout.rstrip("\n").rpartition("\n")
    assert report.startswith("{"), done.stderr
    return output, json.loads(report)


@pytest.mark.parametrize(
    "args", [("--help",), ("show", "--help"), ("events", "--help"), ("payments", "--help")]
)
def test_help_imports_none_of_the_heavy_libraries(args: tuple[str, ...]) -> None:
    # Configured URLs must not make --help check them (that would import both drivers).
    env = child_env(ORDERS_DATABASE_URL="postgresql://u@db/x", ORDERS_REDIS_URL="redis://r/0")

    output, report = run_probe(*args, env=env)

    assert report == {"code": 0, "loaded": []}
    assert "Usage: orders" in output


def check_show(env: dict[str, str]) -> None:
    created = run_orders("create", "u1", "--ttl", "600", "--json", env=env)
    assert created.returncode == 0, created.stderr
    order_id = json.loads(created.stdout)["id"]

    output, report = run_probe("show", order_id, env=env)

    assert report["code"] == 0
    assert output.startswith(f"{order_id}  user u1  unpaid")
    # It did query both stores: the drivers' libraries are there, and nothing else heavy
    # (the schema is current, so no Alembic; one line printed, so no rich).
    assert report["loaded"] == ["redis", "sqlalchemy"]


def test_show_on_the_embedded_default_imports_only_what_it_queries_with(home: Path) -> None:
    check_show(child_env(ORDERS_HOME=str(home)))


def test_show_on_configured_stores_imports_only_what_it_queries_with(
    database_url: str, redis_url: str, tmp_path: Path
) -> None:
    env = child_env(
        ORDERS_HOME=str(tmp_path / "unused"),
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_url,
    )
    check_show(env)


def test_metrics_load_prometheus_client_on_first_use() -> None:
    probe = (
        "import sys; from orders import metrics; before = 'prometheus_client' in sys.modules; "
        "metrics.CANCELS.inc(); from prometheus_client import REGISTRY; "
        "print(before, REGISTRY.get_sample_value('orders_cancels_total'), "
        "REGISTRY.get_sample_value('orders_backlog'))"
    )
    done = run_python("-c", probe, env=child_env())
    # Every metric is registered by the first read of any of them.
    assert done.stdout.split() == ["False", "1.0", "0.0"], done.stderr


# --- the schema check every command runs, without Alembic -------------------------------


def test_the_scripts_head_read_without_alembic_is_alembics() -> None:
    assert migrate.script_heads() == {migrate.head_revision()}


def test_the_scripts_are_parsed_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each service build checks the schema; parsing every script each time held the GIL
    for milliseconds that an event loop beside the build waited out."""
    heads = migrate.script_heads()

    def parse_again(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the scripts were parsed again")

    monkeypatch.setattr(migrate, "ast", SimpleNamespace(parse=parse_again))
    assert migrate.script_heads() == heads
    assert migrate.script_revisions() >= heads


def test_is_current_follows_the_recorded_revision(engine: Engine) -> None:
    assert migrate.is_current(engine)

    migrate.downgrade(engine, "0003")
    assert migrate.stored_revisions(engine) == {"0003"}
    assert not migrate.is_current(engine)

    migrate.downgrade(engine, "base")  # the version table stays, empty
    assert migrate.stored_revisions(engine) == set()
    assert not migrate.is_current(engine)

    migrate.upgrade(engine)
    assert migrate.is_current(engine)
