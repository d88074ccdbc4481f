"""Worker processes for the concurrency tests, and the helpers the tests use to run them.

A worker is started as ``python -m tests.concurrency.worker MODE CONFIG_JSON`` with the
repository root as its working directory and the test's stores in ``ORDERS_DATABASE_URL``
and ``ORDERS_REDIS_URL`` (every other ``ORDERS_*`` variable stripped). It runs on the system
clock, like a real checkout or scheduler process. The protocol, one line at a time:

* the worker builds its service and prints ``READY`` on stdout;
* the test writes ``GO`` (or ``GO <json>``, the mode's payload) on its stdin; all workers
  of a test are released together that way, after their slow start-up;
* the worker does its work and prints one JSON object of counts as its last stdout line,
  then exits 0. Logs and tracebacks go to stderr;
* ``STOP`` on stdin (or the end of stdin) ends a ``sweep`` worker's loop; the other modes
  end on their own (their helpers stop when their creators or schedules are done).

Modes:

``contend``  16 creator threads (configurable) make ``attempts`` create attempts for one
             user in bursts aligned on wall-clock ticks, so the attempts of every process
             arrive together; a payer, a canceller and a sweeper thread work alongside
             until the creators are done.
``pay``      pays a schedule of orders (``GO`` payload), each at its own wall-clock instant,
             from several threads, and reports every outcome.
``sweep``    calls ``sweep_expired`` in a loop until told to stop.
``drain``    calls ``sweep_expired(batch_size=...)`` in a loop until nothing is due.

Every worker also has a deadline: past it, loops end and the shortfall shows in the counts.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import subprocess
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from tests.helpers import REPO, child_env, stop_process

MODULE = "tests.concurrency.worker"


def now_ms() -> int:
    """Wall-clock integer milliseconds: the same clock the service's default uses."""
    return time.time_ns() // 1_000_000


def sleep_until_ms(target_ms: int) -> None:
    delay = target_ms - now_ms()
    if delay > 0:
        time.sleep(delay / 1000)


def bucket(order_id: str) -> str:
    """Which helper in a ``contend`` run takes this order: ``pay``, ``cancel`` or ``expire``.

    A fixed split by a hash of the id, so every outcome happens and no two helpers chase the
    same order (two payers of one order still race: each worker has its own payer).
    """
    slot = zlib.crc32(order_id.encode()) % 10
    if slot < 4:
        return "pay"
    if slot < 6:
        return "cancel"
    return "expire"


# ============================================================================================
# The test side: start, release, stop and collect workers.
# ============================================================================================


class WorkerProcess:
    """One worker process. ``close()`` always stops it by its PID (terminate, then kill)."""

    def __init__(
        self,
        mode: str,
        config: dict[str, Any],
        env: dict[str, str],
        log_dir: Path,
        module: str = MODULE,
    ) -> None:
        self.mode = mode
        self.name = str(config.get("name", mode))
        self.log_path = log_dir / f"worker-{self.name}.stderr"
        self._stderr: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, mode, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                cwd=REPO,
                env=env,
            )
        except BaseException:
            self._stderr.close()
            raise
        self.pid = self.proc.pid
        self._pending = b""

    def stderr_tail(self, chars: int = 3000) -> str:
        self._stderr.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _fail(self, what: str) -> AssertionError:
        return AssertionError(
            f"worker {self.name} (pid {self.pid}, exit {self.proc.poll()}): {what}\n"
            f"--- its stderr ---\n{self.stderr_tail()}"
        )

    def wait_ready(self, deadline: float) -> None:
        """Read the READY line with os.read (no buffered reader holding later output)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail("not ready in time")
            # epoll (the default selector), not select(): select refuses descriptors past
            # 1024, which a test process that has opened many connections reaches.
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                readable = selector.select(remaining)
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise self._fail("exited before it was ready")
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        if line.strip() != b"READY":
            raise self._fail(f"said {line[:200]!r} instead of READY")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._fail(f"stdin closed before {line[:20]!r}") from None

    def go(self, payload: Any = None) -> None:
        self.send("GO" if payload is None else "GO " + json.dumps(payload))

    def stop(self) -> None:
        self.send("STOP")

    def result(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the worker to exit 0 and return its JSON counts."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise self._fail(f"did not finish within {timeout_s} s") from None
        out = self._pending + out
        if self.proc.returncode != 0:
            raise self._fail(f"exited with {self.proc.returncode}; stdout {out[-500:]!r}")
        lines = [line for line in out.decode().splitlines() if line.strip()]
        if not lines:
            raise self._fail("printed no result")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def close(self) -> None:
        """Stop the process by its PID if it still runs, reap it, close the pipes."""
        try:
            stop_process(self.proc)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    with suppress(OSError):
                        stream.close()
            self._stderr.close()


@contextmanager
def started(
    specs: list[tuple[str, dict[str, Any]]],
    *,
    database_url: str,
    redis_options: dict[str, Any],
    log_dir: Path,
    ready_timeout_s: float = 90,
    module: str = MODULE,
    extra_env: dict[str, str] | None = None,
) -> Iterator[list[WorkerProcess]]:
    """Start one worker per (mode, config), wait until all are READY, stop them all at the end.

    ``module`` is the worker's module (run with ``python -m``); ``extra_env`` adds variables
    (more ``ORDERS_*`` settings) to the children's environment."""
    env = child_env(
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_options["redis_url"],
        ORDERS_REDIS_CLUSTER=str(redis_options["redis_cluster"]).lower(),
        **(extra_env or {}),
    )
    workers: list[WorkerProcess] = []
    try:
        for mode, config in specs:
            workers.append(WorkerProcess(mode, config, env, log_dir, module))
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


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal integers (the first ones one larger)."""
    return [total // parts + (1 if n < total % parts else 0) for n in range(parts)]


# ============================================================================================
# The worker side.
# ============================================================================================


class Tally:
    """Thread-safe counters, id lists and a few error samples, as one JSON object."""

    def __init__(self, **initial: Any) -> None:
        self._lock = threading.Lock()
        self.data: dict[str, Any] = {"errors": 0, "error_samples": [], **initial}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.data[key] = self.data.get(key, 0) + n

    def append(self, key: str, value: Any) -> None:
        with self._lock:
            self.data.setdefault(key, []).append(value)

    def put(self, key: str, sub: str, value: Any) -> None:
        with self._lock:
            self.data.setdefault(key, {})[sub] = value

    def error(self, where: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.data["errors"] += 1
            if len(self.data["error_samples"]) < 10:
                self.data["error_samples"].append(f"{where}: {text}")


def run_threads(targets: list[Callable[[], None]], tally: Tally) -> None:
    """Run the targets in threads and wait; an escaping exception counts as an error."""

    def wrap(name: str, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                tally.error(f"{name} crashed", "".join(traceback.format_exception(exc))[-800:])

        return run

    threads = [
        threading.Thread(target=wrap(f"thread {n}", t), daemon=True) for n, t in enumerate(targets)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def contend(service: Any, cfg: dict[str, Any], stop: threading.Event, deadline: float) -> Tally:
    from orders.domain import OrderStatus  # noqa: PLC0415
    from orders.errors import (  # noqa: PLC0415
        OrderAlreadyPaid,
        OrderClosed,
        UnpaidOrderLimitReached,
    )
    from orders.sql.records import LimitReachedInSql  # noqa: PLC0415

    name, user, limit = cfg["name"], cfg["user"], cfg["limit"]
    ttl_lo, ttl_hi = cfg["ttl_ms"]
    tick_ms, pace_ticks = cfg["tick_ms"], cfg["pace_ticks"]
    tally = Tally(
        name=name,
        attempts=0,
        admitted=0,
        refused=0,
        paid=0,
        cancelled=0,
        closed=0,
        pay_lost=0,
        cancel_lost=0,
        sweeps=0,
        sweep_redis_errors=0,
        sql_refused=0,
        admitted_ids=[],
        paid_refs={},
        cancelled_ids=[],
    )
    guard = service.records.insert_guarded

    def counted_guard(values: dict[str, Any], limit: int, now: int) -> Any:
        # Count the refusals that came from the SQL guard rather than from Redis.
        try:
            return guard(values, limit, now)
        except LimitReachedInSql:
            tally.add("sql_refused")
            raise

    service.records.insert_guarded = counted_guard
    creators_done = threading.Event()
    remaining = [cfg["threads"]]
    lock = threading.Lock()

    def creator(number: int, attempts: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(f"{cfg['seed']}-{name}-{number}")
            try:
                for _ in range(attempts):
                    if time.monotonic() > deadline:
                        tally.error("creator", "deadline passed")
                        return
                    # Sleep to a tick boundary a random number of ticks ahead: every thread
                    # of every process fires on the same boundaries, in bursts.
                    ticks = rng.randint(1, 2 * pace_ticks - 1)
                    sleep_until_ms((now_ms() // tick_ms + ticks) * tick_ms)
                    ttl_ms = rng.randint(ttl_lo, ttl_hi)
                    tally.add("attempts")
                    try:
                        order = service.create_unpaid_order(user, ttl_s=ttl_ms / 1000, limit=limit)
                    except UnpaidOrderLimitReached as exc:
                        tally.add("refused")
                        if exc.limit != limit or exc.open_count < limit:
                            tally.error("create", f"refused with {exc.open_count} of {exc.limit}")
                    except Exception as exc:
                        tally.error("create", exc)
                    else:
                        tally.add("admitted")
                        tally.append("admitted_ids", order.id)
                        if (
                            order.user_id != user
                            or order.status is not OrderStatus.UNPAID
                            or order.expires_at_ms - order.created_at_ms != ttl_ms
                        ):
                            tally.error("create", f"odd order returned: {order!r}")
            finally:
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        creators_done.set()

        return run

    def payer() -> None:
        rng = random.Random(f"{cfg['seed']}-{name}-payer")
        while not creators_done.wait(rng.uniform(*cfg["pay_every_s"])):
            try:
                listed = service.list_unpaid(user)
            except Exception as exc:
                tally.error("list_unpaid", exc)
                continue
            for order in listed:
                if bucket(order.id) != "pay":
                    continue
                ref = f"{name}-pay-{order.id}"
                try:
                    result = service.mark_paid(order.id, payment_ref=ref)
                except (OrderAlreadyPaid, OrderClosed):
                    tally.add("pay_lost")
                except Exception as exc:
                    tally.error("mark_paid", exc)
                else:
                    if result.status is not OrderStatus.PAID or result.payment_ref != ref:
                        tally.error("mark_paid", f"odd order returned: {result!r}")
                    tally.add("paid")
                    tally.put("paid_refs", order.id, ref)

    def canceller() -> None:
        rng = random.Random(f"{cfg['seed']}-{name}-canceller")
        reason = f"{name}-cancel"
        while not creators_done.wait(rng.uniform(*cfg["cancel_every_s"])):
            try:
                listed = service.list_unpaid(user)
            except Exception as exc:
                tally.error("list_unpaid", exc)
                continue
            for order in listed:
                if bucket(order.id) != "cancel":
                    continue
                try:
                    result = service.cancel_order(order.id, reason=reason)
                except (OrderAlreadyPaid, OrderClosed):
                    tally.add("cancel_lost")
                except Exception as exc:
                    tally.error("cancel_order", exc)
                else:
                    if result.status is not OrderStatus.CANCELLED:
                        tally.error("cancel_order", f"odd order returned: {result!r}")
                    elif result.close_reason == reason:  # ours won (not another canceller's)
                        tally.add("cancelled")
                        tally.append("cancelled_ids", order.id)
                    else:
                        tally.add("cancel_lost")

    def sweeper() -> None:
        rng = random.Random(f"{cfg['seed']}-{name}-sweeper")
        while not creators_done.wait(rng.uniform(*cfg["sweep_every_s"])):
            try:
                result = service.sweep_expired()
            except Exception as exc:
                tally.error("sweep_expired", exc)
                continue
            tally.add("sweeps")
            tally.add("closed", result.closed)
            tally.add("sweep_redis_errors", result.redis_errors)

    per_thread = split(cfg["attempts"], cfg["threads"])
    targets = [creator(n, a) for n, a in enumerate(per_thread)]
    run_threads([*targets, payer, canceller, sweeper], tally)
    return tally


def pay(service: Any, cfg: dict[str, Any], payload: Any, deadline: float) -> Tally:
    """Pay each scheduled order at its instant; record what every call returned or raised."""
    from orders.domain import OrderStatus  # noqa: PLC0415
    from orders.errors import OrderClosed  # noqa: PLC0415

    schedule = sorted(payload["schedule"], key=lambda item: item["at_ms"])
    tally = Tally(name=cfg["name"], payments=0, paid=0, refused_closed=0, outcomes={})
    lock = threading.Lock()
    position = [0]

    def next_item() -> dict[str, Any] | None:
        with lock:
            if position[0] >= len(schedule):
                return None
            item: dict[str, Any] = schedule[position[0]]
            position[0] += 1
            return item

    def payer() -> None:
        while (item := next_item()) is not None:
            if time.monotonic() > deadline:
                tally.error("payer", "deadline passed")
                return
            sleep_until_ms(item["at_ms"])
            oid, ref = item["order_id"], item["ref"]
            started_ms = now_ms()
            tally.add("payments")
            outcome: dict[str, Any]
            try:
                order = service.mark_paid(oid, payment_ref=ref)
            except OrderClosed as exc:
                outcome = {"outcome": "closed", "status": exc.status}
                tally.add("refused_closed")
            except Exception as exc:
                outcome = {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}
                tally.error("mark_paid", exc)
            else:
                outcome = {
                    "outcome": "paid",
                    "status": order.status.value,
                    "ref": order.payment_ref,
                }
                if order.status is not OrderStatus.PAID or order.payment_ref != ref:
                    tally.error("mark_paid", f"odd order returned: {order!r}")
                tally.add("paid")
            outcome["start_ms"] = started_ms
            outcome["end_ms"] = now_ms()
            tally.put("outcomes", oid, outcome)

    run_threads([payer] * cfg["threads"], tally)
    return tally


def sweep(service: Any, cfg: dict[str, Any], stop: threading.Event, deadline: float) -> Tally:
    """sweep_expired in a loop until STOP; counts what this process closed."""
    tally = Tally(name=cfg["name"], sweeps=0, closed=0, batches=0, redis_errors=0, max_lag_ms=0)
    rng = random.Random(cfg["name"])
    while not stop.is_set():
        if time.monotonic() > deadline:
            tally.error("sweeper", "deadline passed")
            break
        try:
            result = service.sweep_expired()
        except Exception as exc:
            tally.error("sweep_expired", exc)
        else:
            tally.add("sweeps")
            tally.add("closed", result.closed)
            tally.add("batches", result.batches)
            tally.add("redis_errors", result.redis_errors)
            if result.max_lag_ms is not None:
                tally.data["max_lag_ms"] = max(tally.data["max_lag_ms"], result.max_lag_ms)
        stop.wait(rng.uniform(*cfg["every_s"]))
    return tally


def drain(service: Any, cfg: dict[str, Any], deadline: float) -> Tally:
    """sweep_expired(batch_size=...) in a loop until a call closes nothing and none is due."""
    size = cfg["batch_size"]
    tally = Tally(name=cfg["name"], calls=0, closed=0, batches=0, redis_errors=0, idle_calls=0)
    started = time.monotonic()
    while True:
        if time.monotonic() > deadline:
            tally.error("drain", "deadline passed")
            break
        try:
            result = service.sweep_expired(batch_size=size)
        except Exception as exc:
            tally.error("sweep_expired", exc)
            continue
        tally.add("calls")
        tally.add("closed", result.closed)
        tally.add("batches", result.batches)
        tally.add("redis_errors", result.redis_errors)
        if result.closed == 0:
            # Nothing claimable: either all done, or the rest is locked by other sweepers.
            tally.add("idle_calls")
            if service.count_due() == 0:
                break
            time.sleep(0.005)
    tally.data["elapsed_s"] = round(time.monotonic() - started, 3)
    return tally


def main(argv: list[str]) -> int:
    mode, config = argv[0], json.loads(argv[1])
    from orders.bootstrap import build_service  # noqa: PLC0415
    from orders.config import Settings  # noqa: PLC0415

    settings = Settings.from_env(
        sql_pool_size=config.get("pool_size", 5), sql_max_overflow=config.get("max_overflow", 10)
    )
    service = build_service(settings)
    pool = service.engine.pool
    pool_capacity = pool.size() + getattr(pool, "_max_overflow", 0) if hasattr(pool, "size") else -1
    try:
        print("READY", flush=True)
        line = sys.stdin.readline()
        if not line.startswith("GO"):
            print(f"expected GO, got {line[:40]!r}", file=sys.stderr)
            return 2
        payload = json.loads(line[2:]) if line[2:].strip() else None
        stop = stop_on_stdin()
        deadline = time.monotonic() + config.get("deadline_s", 240)
        started = time.monotonic()
        if mode == "contend":
            tally = contend(service, config, stop, deadline)
        elif mode == "pay":
            tally = pay(service, config, payload, deadline)
        elif mode == "sweep":
            tally = sweep(service, config, stop, deadline)
        elif mode == "drain":
            tally = drain(service, config, deadline)
        else:
            print(f"unknown mode {mode!r}", file=sys.stderr)
            return 2
        tally.data.setdefault("elapsed_s", round(time.monotonic() - started, 3))
        tally.data["pid"] = os.getpid()
        tally.data["pool_capacity"] = pool_capacity
        print(json.dumps(tally.data), flush=True)
        return 0
    finally:
        close_service(service)


def stop_on_stdin() -> threading.Event:
    """An event set by ``STOP`` on stdin, or by the end of stdin (read in a thread)."""
    stop = threading.Event()

    def watch_stdin() -> None:
        for command in sys.stdin:
            if command.strip() == "STOP":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    return stop


def close_service(service: Any) -> None:
    """Close what a worker's service opened: the SQL pool and the Redis client."""
    service.engine.dispose()
    service.index.client.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
