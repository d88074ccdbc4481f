"""Child processes of the tests: how to start one, the one wrapper of a process a test
talks to or kills, and the end of each by its PID.

:class:`ChildProcess` runs ``python ARGS`` from the checkout with its stderr in a file.
With ``talk=True`` its stdin and stdout are pipes for the protocol of the load workers
(``tests/support/workers``), one line at a time:

* the worker builds its service and prints ``READY`` on stdout;
* the test writes ``GO`` (or ``GO <json>``, the mode's payload) on its stdin; all workers
  of a test are released together that way, after their slow start-up (:func:`started`);
* the worker does its work and prints one JSON object of counts as its last stdout line,
  then exits 0. Logs and tracebacks go to stderr;
* ``STOP`` on stdin (or the end of stdin) ends the loops of a mode that runs until told.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from orders.embedded.server import redis_status
from tests.support.workers.sync import MODULE as SYNC_WORKER

#: The checkout: the working directory of child processes, first on their PYTHONPATH.
REPO = Path(__file__).resolve().parents[2]


#: The ORDERS_* variables children inherit: which redis-server an embedded default runs, and
#: which event loop the async workers run (``tests.support.aio``: loop_kind).
KEPT_ENV = {"ORDERS_REDIS_SERVER", "ORDERS_TEST_LOOP"}


def child_env(**orders_env: str) -> dict[str, str]:
    """A child's environment: ours without any ORDERS_* variable (a developer's own settings
    never leak in) but those of :data:`KEPT_ENV` (the binary of the test's run, see
    ``tests/conftest.py``: redis_binary; the tests' event loop), with this checkout first on
    PYTHONPATH, plus ``orders_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORDERS_") or k in KEPT_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(orders_env)
    return env


def run_python(
    *args: str, env: dict[str, str], cwd: Path = REPO, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` to its end: exit status, stdout and stderr as text (never raises on a
    non-zero exit; the caller asserts on it)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def run_orders(
    *args: str, env: dict[str, str], cwd: Path = REPO, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """The ``orders`` command (``python -m orders ARGS``) as a real process, to its end."""
    return run_python("-m", "orders", *args, env=env, cwd=cwd, timeout_s=timeout_s)


def stop_process(
    proc: subprocess.Popen[Any], *, signum: int = signal.SIGTERM, timeout_s: float = 10
) -> int:
    """End a child we started, by its PID: ``signum``, then SIGKILL if it is still there
    after ``timeout_s``. Reaps it and returns its exit status (also if it had already ended)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout_s)


def kill_embedded_redis(home: Path) -> None:
    """For cleanup: SIGKILL the embedded redis-server of ``home`` by its PID, if one runs."""
    running = redis_status(home)
    if running is not None:
        os.kill(running.pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not reaped by init) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in {"Z", "X"}


def wait_dead(pid: int, timeout_s: float = 15.0) -> bool:
    """Until ``pid`` no longer runs (False: it still did after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def servers_under(base: Path) -> list[int]:
    """Live processes (not zombies) whose working dir is under ``base``: redis-server chdirs
    to its --dir, so these are the embedded servers of homes under ``base``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if cwd.is_relative_to(base) and state not in {"Z", "X"}:
            found.append(int(entry.name))
    return sorted(found)


def free_port() -> int:
    """A TCP port free on loopback right now (the kernel's pick; a child binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ChildProcess:
    """A process of ours: ``python ARGS`` from the checkout, its stderr in ``log_path``.
    ``close()`` always ends it by its PID (``signum``, then SIGKILL) and reaps it.

    ``talk``: stdin and stdout are pipes, for the worker protocol (the module docstring);
    else both are /dev/null, and the test watches the stderr (:meth:`wait_for`). ``name``:
    a worker's, from its config (tests name its files after it)."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: Path,
        *,
        name: str = "",
        talk: bool = False,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._stderr: IO[bytes] = open(log_path, "wb")  # noqa: SIM115
        pipe = subprocess.PIPE if talk else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, *args],
                stdin=pipe,
                stdout=pipe,
                stderr=self._stderr,
                cwd=REPO,
                env=env,
            )
        except BaseException:
            self._stderr.close()
            raise
        self.pid = self.proc.pid
        self._pending = b""

    # --- what it wrote, what went wrong -------------------------------------------------------

    def log(self) -> str:
        """Its stderr so far ("" if the file cannot be read)."""
        with contextlib.suppress(ValueError):  # already closed: the file holds it all
            self._stderr.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def fail(self, what: str) -> AssertionError:
        """An AssertionError naming the process, its exit status, ``what``, and its stderr."""
        who = f"worker {self.name}" if self.name else "process"
        return AssertionError(
            f"{who} (pid {self.pid}, exit {self.proc.poll()}): {what}\n"
            f"--- its stderr ---\n{self.log()[-3000:]}"
        )

    def wait_for(self, needle: str, timeout_s: float) -> float:
        """Wait until ``needle`` appears in its stderr; the monotonic time it was seen."""
        deadline = time.monotonic() + timeout_s
        while True:
            if needle in self.log():
                return time.monotonic()
            if self.proc.poll() is not None:
                raise self.fail(f"exited before it printed {needle!r}")
            if time.monotonic() > deadline:
                raise self.fail(f"did not print {needle!r} within {timeout_s} s")
            time.sleep(0.005)

    # --- the worker protocol (``talk=True``) --------------------------------------------------

    def wait_ready(self, deadline: float) -> None:
        """Read the READY line with os.read (no buffered reader holding later output)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.fail("not ready in time")
            # epoll (the default selector), not select(): select refuses descriptors past
            # 1024, which a test process that has opened many connections reaches.
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                readable = selector.select(remaining)
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise self.fail("exited before it was ready")
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        if line.strip() != b"READY":
            raise self.fail(f"said {line[:200]!r} instead of READY")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.fail(f"stdin closed before {line[:20]!r}") from None

    def go(self, payload: Any = None) -> None:
        self.send("GO" if payload is None else "GO " + json.dumps(payload))

    def stop(self) -> None:
        """Tell it to end its loops (``STOP``); :meth:`result` then waits for its counts."""
        self.send("STOP")

    def output_at_exit(self, timeout_s: float) -> bytes:
        """Wait for it to exit (however it ends) and return what it printed after READY."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise self.fail(f"did not finish within {timeout_s} s") from None
        return self._pending + (out or b"")

    def result(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the worker to exit 0 and return its JSON counts."""
        out = self.output_at_exit(timeout_s)
        if self.proc.returncode != 0:
            raise self.fail(f"exited with {self.proc.returncode}; stdout {out[-500:]!r}")
        lines = [line for line in out.decode().splitlines() if line.strip()]
        if not lines:
            raise self.fail("printed no result")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    # --- the end --------------------------------------------------------------------------------

    def kill_at_marker(self, marker: Path, timeout_s: float) -> None:
        """Wait for the worker to write ``marker`` (it stopped where its test asked: a
        ``<marker>.error`` file or its exit fails the test instead), then SIGKILL it by its
        PID; whatever happens, the process is gone when this returns."""
        try:
            deadline = time.monotonic() + timeout_s
            while not marker.exists():
                error = marker.with_name(marker.name + ".error")
                if error.exists():
                    raise self.fail(error.read_text())
                if self.proc.poll() is not None:
                    raise self.fail("exited before its stop")
                assert time.monotonic() < deadline, "the worker did not reach its stop in time"
                time.sleep(0.005)
            assert self.sigkill() == -signal.SIGKILL
        finally:
            self.close(signum=signal.SIGKILL)

    def sigkill(self) -> int:
        """SIGKILL it by PID and reap it; its exit status (-9 if it was still running)."""
        return stop_process(self.proc, signum=signal.SIGKILL, timeout_s=30)

    def close(self, *, signum: int = signal.SIGTERM) -> None:
        """End it by its PID if it still runs (``signum``, then SIGKILL), reap it, close
        the pipes and the log."""
        try:
            stop_process(self.proc, signum=signum)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            self._stderr.close()


class WorkerCrash:
    """Runs a crash worker (``python -m MODULE MARKER MODE CONFIG``) on the test's stores
    until it writes its marker at the step ``MODE`` names, then SIGKILLs it by its PID."""

    def __init__(
        self,
        module: str,
        database_url: str,
        redis_options: dict[str, Any],
        tmp_path: Path,
        marker_timeout_s: float = 60,
    ) -> None:
        self.module = module
        self.env = child_env(
            ORDERS_DATABASE_URL=database_url,
            ORDERS_REDIS_URL=redis_options["redis_url"],
            ORDERS_REDIS_CLUSTER=str(redis_options["redis_cluster"]).lower(),
        )
        self.tmp_path = tmp_path
        self.marker_timeout_s = marker_timeout_s

    def kill_at(self, mode: str, **config: Any) -> None:
        marker = self.tmp_path / f"stopped-{mode}"
        worker = ChildProcess(
            ["-m", self.module, str(marker), mode, json.dumps(config)],
            self.env,
            self.tmp_path / f"worker-{mode}.log",
        )
        worker.kill_at_marker(marker, self.marker_timeout_s)


@contextmanager
def started(
    specs: list[tuple[str, dict[str, Any]]],
    *,
    database_url: str,
    redis_options: dict[str, Any],
    log_dir: Path,
    ready_timeout_s: float = 90,
    module: str = SYNC_WORKER,
    extra_env: dict[str, str] | None = None,
) -> Iterator[list[ChildProcess]]:
    """Start one worker per (mode, config), wait until all are READY, stop them all at the end.

    ``module`` is the worker's module (run with ``python -m``, ``MODE CONFIG_JSON`` its
    arguments); ``extra_env`` adds variables (more ``ORDERS_*`` settings) to the children's
    environment, which holds the test's stores."""
    env = child_env(
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_options["redis_url"],
        ORDERS_REDIS_CLUSTER=str(redis_options["redis_cluster"]).lower(),
        **(extra_env or {}),
    )
    workers: list[ChildProcess] = []
    try:
        for mode, config in specs:
            name = str(config.get("name", mode))
            args = ["-m", module, mode, json.dumps(config)]
            log_path = log_dir / f"worker-{name}.stderr"
            workers.append(ChildProcess(args, env, log_path, name=name, talk=True))
        deadline = time.monotonic() + ready_timeout_s
        for worker in workers:
            worker.wait_ready(deadline)
        yield workers
    finally:
        errors: list[BaseException] = []
        for worker in workers:
            try:
                worker.close()
            except BaseException as exc:  # close the others whatever happens
                errors.append(exc)
        if errors:
            raise errors[0]
