"""A throwaway PostgreSQL server for the test session: initdb + postgres on a unix socket;
and where the tests make their databases (that server, or ``ORDERS_TEST_DATABASE_URL``).

The binaries come from the system (/usr/lib/postgresql/*/bin, or initdb on PATH). PostgreSQL
refuses to run as root, so as root the server runs as the unprivileged user ``nobody``.
The server listens on no TCP address, only on a socket in its private folder, and the test
session stops it by its PID.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

UNPRIVILEGED_USER = "nobody"
#: What a test server gives up for speed: the tests never outlive a crash of it.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
#: As production runs it: every commit reaches the disk (benchmarks, soak).
DURABLE_SETTINGS = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


def find_postgres_bin() -> Path | None:
    def version(initdb: str) -> int:
        name = Path(initdb).parent.parent.name
        return int(name) if name.isdigit() else 0

    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class PostgresServer:
    """``start()`` then ``url(dbname)``; ``stop()`` ends the server and removes its files."""

    def __init__(
        self, bindir: Path, *, durable: bool = False, settings: dict[str, str] | None = None
    ) -> None:
        """``durable``: fsync and synchronous commits on; ``settings``: more ``-c`` options."""
        self.bindir = bindir
        self.settings = {**(DURABLE_SETTINGS if durable else FAST_SETTINGS), **(settings or {})}
        self.folder = Path(tempfile.mkdtemp(prefix="orders-pg-", dir="/tmp"))
        self.data = self.folder / "data"
        self.proc: subprocess.Popen[bytes] | None = None
        self.as_user = UNPRIVILEGED_USER if os.geteuid() == 0 else None

    def _run_as(self) -> dict[str, str]:
        return {"user": self.as_user} if self.as_user else {}

    def start(self, timeout_s: float = 60) -> PostgresServer:
        if self.as_user:
            shutil.chown(self.folder, user=self.as_user)
        os.chmod(self.folder, 0o700)
        subprocess.run(
            [
                str(self.bindir / "initdb"),
                "-D", str(self.data),
                "-U", "orders",
                "--auth=trust",
                "-E", "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            cwd=self.folder,
            **self._run_as(),  # type: ignore[arg-type]
        )  # fmt: skip
        return self.launch(timeout_s)

    def launch(self, timeout_s: float = 60) -> PostgresServer:
        """Start the server on the existing data folder; return once it takes connections."""
        log = open(self.folder / "postgres.log", "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [
                    str(self.bindir / "postgres"),
                    "-D", str(self.data),
                    "-k", str(self.folder),
                    "-c", "listen_addresses=",
                    "-c", "max_connections=300",
                    "-c", "shared_buffers=128MB",
                    *(a for n, v in self.settings.items() for a in ("-c", f"{n}={v}")),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.folder,
                **self._run_as(),  # type: ignore[arg-type]
            )  # fmt: skip
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    "postgres exited: " + (self.folder / "postgres.log").read_text()[-2000:]
                )
            try:
                with psycopg.connect(self.dsn("postgres"), connect_timeout=2):
                    return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def shut_down(self, timeout_s: float = 30) -> None:
        """A "fast" shutdown (SIGINT, what ``pg_ctl stop -m fast`` sends): open transactions
        roll back, clients are disconnected, the data folder stays for :meth:`launch`."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def dsn(self, dbname: str) -> str:
        return f"host={self.folder} user=orders dbname={dbname}"

    def url(self, dbname: str) -> str:
        return f"postgresql+psycopg://orders@/{dbname}?host={self.folder}"

    def execute(self, sql: str) -> None:
        """Run one statement outside a transaction (CREATE/DROP DATABASE) on ``postgres``."""
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(sql)  # type: ignore[call-overload]

    def stop(self) -> None:
        self.shut_down()
        shutil.rmtree(self.folder, ignore_errors=True)


class PostgresTarget:
    """Where PostgreSQL test databases are made: our own server, or ORDERS_TEST_DATABASE_URL."""

    def __init__(self, base_url: str, server: PostgresServer | None) -> None:
        self.base = make_url(base_url)
        self.server = server
        self._counter = itertools.count()

    def url(self, dbname: str) -> str:
        return self.base.set(database=dbname).render_as_string(hide_password=False)

    def execute(self, sql: str) -> None:
        engine = create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(sql)
        finally:
            engine.dispose()

    def new_database(self, template: str | None = None) -> str:
        name = f"orders_test_{os.getpid()}_{next(self._counter)}"
        self.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
        return name

    def drop_database(self, name: str) -> None:
        self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
