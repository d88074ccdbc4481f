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
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

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
        #: Emptied copies of each template, and each template's shape (see copy_of).
        self._free: dict[str, list[str]] = {}
        self._shapes: dict[str, str] = {}
        #: One idle session per copy, kept for its next hand-back (a connection costs
        #: about as much as emptying the copy).
        self._admin: dict[str, Engine] = {}

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
        admin = self._admin.pop(name, None)
        if admin is not None:
            admin.dispose()
        self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    # --- copies of a migrated template, emptied and used again --------------------------

    def copy_of(self, template: str) -> str:
        """A database in the state of ``template``: one handed back clean (see
        :meth:`hand_back`), else a new copy. A copy costs about 300 ms (CREATE DATABASE
        ... TEMPLATE); emptying one about a tenth of that."""
        free = self._free.setdefault(template, [])
        if template not in self._shapes:
            self._shapes[template] = self._shape(template)
        return free.pop() if free else self.new_database(template)

    def hand_back(self, name: str, template: str) -> None:
        """Empty ``name`` for the next test if nothing but rows differs from ``template``;
        else drop it. Anything a test changed beyond rows (a table, an index, a trigger, a
        function, a schema, a database setting, the recorded revision), statistics it
        gathered (ANALYZE, which plans depend on), a session still connected or a prepared
        transaction: dropped, never used again."""
        try:
            reusable = self._reusable(name, template)
        except Exception:  # the database is in a state this cannot read: not reused
            reusable = False
        if reusable:
            self._free.setdefault(template, []).append(name)
        else:
            self.drop_database(name)

    def drop_free(self) -> None:
        for names in self._free.values():
            for name in names:
                self.drop_database(name)
        self._free.clear()
        self.close()

    def close(self) -> None:
        """Close the sessions kept for hand-backs (before the server stops)."""
        for engine in self._admin.values():
            engine.dispose()
        self._admin.clear()

    def _shape(self, name: str) -> str:
        engine = create_engine(self.url(name), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                return str(conn.exec_driver_sql(_SHAPE).scalar_one())
        finally:
            engine.dispose()

    def _reusable(self, name: str, template: str) -> bool:
        engine = self._admin.get(name)
        if engine is None:
            engine = create_engine(
                self.url(name), isolation_level="AUTOCOMMIT", pool_size=1, pool_pre_ping=True
            )
            self._admin[name] = engine
        with engine.connect() as conn:
            # One statement, one round trip (this runs after every PostgreSQL test): it
            # raises, and the copy is dropped, when the copy is in use or changed shape.
            try:
                conn.exec_driver_sql(_RESET.replace("{shape}", self._shapes[template]))
            except DBAPIError as exc:
                if _NOT_REUSABLE in str(exc.orig):
                    return False
                raise
            return True


#: Everything about a database but its rows, as one digest: relations and their columns,
#: indexes, constraints, triggers, functions, schemas, per-database settings, the recorded
#: migration revision, and whether statistics were gathered.
_SHAPE = """
SELECT md5(string_agg(item, ' | ' ORDER BY item)) FROM (
  SELECT 'rel ' || c.relname || ' ' || c.relkind::text AS item
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
   WHERE n.nspname = 'public'
  UNION ALL
  SELECT 'col ' || table_name || '.' || column_name || ' ' || data_type || ' '
         || is_nullable || ' ' || coalesce(column_default, '')
    FROM information_schema.columns WHERE table_schema = 'public'
  UNION ALL
  SELECT 'idx ' || indexdef FROM pg_indexes WHERE schemaname = 'public'
  UNION ALL
  SELECT 'con ' || conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
   WHERE connamespace = 'public'::regnamespace
  UNION ALL
  SELECT 'trg ' || tgname || ' ' || tgrelid::regclass::text FROM pg_trigger WHERE NOT tgisinternal
  UNION ALL
  SELECT 'fn ' || proname || ' ' || md5(prosrc) FROM pg_proc
   WHERE pronamespace = 'public'::regnamespace
  UNION ALL
  SELECT 'nsp ' || nspname FROM pg_namespace
   WHERE nspname !~ '^pg_' AND nspname <> 'information_schema'
  UNION ALL
  SELECT 'set ' || array_to_string(setconfig, ',') FROM pg_db_role_setting
   WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
  UNION ALL
  SELECT 'rev ' || version_num FROM oes_alembic_version
  UNION ALL
  SELECT 'analyzed ' || relname FROM pg_stat_user_tables
   WHERE analyze_count + autoanalyze_count > 0
) AS shape
"""
#: Another session still connected, or a prepared transaction left behind.
_IN_USE = """
SELECT (SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid())
     + (SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database())
"""
#: What :meth:`PostgresTarget.hand_back` raises with when a copy cannot be used again.
_NOT_REUSABLE = "orders test copy not reusable"
#: Empties a copy unless it is in use or its shape differs from the template's (the
#: ``{shape}`` digest): a TRUNCATE ... RESTART IDENTITY of our tables that hold anything,
#: a heap page (a row, a dead one, a rolled-back insert's) or a used sequence. A table
#: with neither is as the template left it already; truncating it too would only cost
#: (a TRUNCATE makes new files for the table and each of its indexes).
_RESET = f"""
DO $reset$
DECLARE
  listed text;
BEGIN
  -- A session the test closed may still be exiting (a client's close does not wait for
  -- its server process to end): up to 0.1 s for it, then the copy counts as in use.
  FOR attempt IN 1..20 LOOP
    EXIT WHEN ({_IN_USE}) = 0;
    IF attempt = 20 THEN
      RAISE EXCEPTION '{_NOT_REUSABLE}: in use';
    END IF;
    PERFORM pg_sleep(0.005);
    PERFORM pg_stat_clear_snapshot();  -- else the transaction sees its first reading
  END LOOP;
  IF ({_SHAPE}) IS DISTINCT FROM '{{shape}}' THEN
    RAISE EXCEPTION '{_NOT_REUSABLE}: changed shape';
  END IF;
  SELECT string_agg('public.' || quote_ident(c.relname), ', ') INTO listed
    FROM pg_class c
   WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p')
     AND c.relname NOT IN ('oes_alembic_version', 'alembic_version')
     AND (pg_relation_size(c.oid) > 0 OR EXISTS (
          SELECT 1 FROM pg_depend d
            JOIN pg_class sc ON sc.oid = d.objid AND sc.relkind = 'S'
            JOIN pg_sequences s ON s.schemaname = 'public' AND s.sequencename = sc.relname
           WHERE d.classid = 'pg_class'::regclass AND d.refobjid = c.oid
             AND s.last_value IS NOT NULL));
  IF listed IS NOT NULL THEN
    SET LOCAL lock_timeout = '2s';
    EXECUTE 'TRUNCATE ' || listed || ' RESTART IDENTITY CASCADE';
  END IF;
END
$reset$
"""
