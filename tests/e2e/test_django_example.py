"""examples/django_checkout as its users run it: ``python manage.py test`` (Django's own test
runner, its TransactionTestCases driving the views with Django's test client) against a real
redis-server and a real SQLite file or PostgreSQL database, in a child process."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.support.postgres import PostgresTarget
from tests.support.processes import REPO, child_env, run_python

EXAMPLE = REPO / "examples" / "django_checkout"
#: The Django tests in examples/django_checkout/shop/tests.py: all of them must run.
DJANGO_TESTS = 9
LIMIT = 2


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_django_example_passes_its_own_tests_on_real_servers(
    backend: str, redis_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = child_env(ORDERS_REDIS_URL=redis_url, ORDERS_UNPAID_LIMIT=str(LIMIT))
    server: PostgresTarget | None = None
    if backend == "sqlite":
        env["CHECKOUT_SQLITE_PATH"] = str(tmp_path / "checkout.sqlite3")
        test_database = str(tmp_path / "test_checkout.sqlite3")  # Django's test_ prefix
    else:
        postgres: PostgresTarget | str = request.getfixturevalue("postgres")
        if isinstance(postgres, str):
            if os.environ.get("CI") == "true":
                pytest.fail(f"PostgreSQL tests must run in CI: {postgres}")
            pytest.skip(f"PostgreSQL not available: {postgres}")
        server, name = postgres, f"checkout_{os.getpid()}"
        env["CHECKOUT_DATABASE_URL"] = server.url(name)
        test_database = f"test_{name}"
    try:
        # A timeout ends the child by its PID (subprocess.run kills it).
        done = run_python(
            "-W", "error", "manage.py", "test", "--noinput", "-v", "2",
            env=env, cwd=EXAMPLE, timeout_s=90,
        )  # fmt: skip
    finally:
        if server is not None:
            server.drop_database(test_database)  # left behind only if the run failed
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(rf"^Ran {DJANGO_TESTS} tests in ", output, re.MULTILINE), output
    assert re.search(r"^OK$", output, re.MULTILINE), output
    # On the database this test gave it, which Django's runner made and then removed.
    assert f"Creating test database for alias 'default' ('{test_database}')" in output, output
    if backend == "sqlite":
        assert not list(tmp_path.glob("test_checkout.sqlite3*"))  # nor its -wal, -shm
