"""Mutation drill: break each rule that matters with a one-line change, and see a test fail.

Run on demand, not in CI (a full run takes a few minutes):

    .venv/bin/python scripts/mutation_drill.py            # every mutation, writes the results
    .venv/bin/python scripts/mutation_drill.py --list     # names, places and test selections
    .venv/bin/python scripts/mutation_drill.py --only admit-limit-off-by-one,sql-guard-dropped

Each mutation names a file, an exact fragment of it, its replacement, and the tests that must
catch it. The fragment must occur exactly once in the file as it stands: when the code moves,
the drill refuses to run and says which mutations to update, instead of quietly testing
nothing.

The working tree is never written to (but for the results file, at the end). The drill copies
the checkout's files (``git ls-files``: tracked, plus untracked files not ignored, so a test
being written takes part) into a temporary folder and runs pytest there with that copy first
on PYTHONPATH. The editable install points at the checkout, so before anything else the drill
checks that the copy is what Python imports, then applies a sanity mutation that must fail.
A baseline run of every selected test, unmutated, must pass: a failure that happens anyway
proves nothing about a mutation. Each mutation is applied, its tests run
(``-x -q -p no:cacheprovider``, with a time limit), and the original text is put back. The
temporary folder is removed at the end, also after Ctrl-C or SIGTERM.

Exit status: 0 when every mutation was caught, 1 when one survived (or timed out, or its
tests could not run), 2 when the drill could not start (a fragment not found once, a failing
baseline, tests that do not import the copy).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import ClassVar

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MARKDOWN = Path("docs/mutation-drill.md")
#: How long one mutation's tests may run before the drill stops them (pytest's own per-test
#: timeout, 120 s, normally fires first).
DEFAULT_TIMEOUT_S = 300.0
#: After SIGINT, how long pytest gets to run its finalizers (stop its servers) before SIGKILL.
INTERRUPT_GRACE_S = 20.0
PYTEST_FLAGS = ("-x", "-q", "-p", "no:cacheprovider")
#: How many failed node ids a result keeps.
FAILED_SHOWN = 3


@dataclass(frozen=True, slots=True)
class Mutation:
    """One named break: ``original`` (exactly once in ``path``) becomes ``replacement``."""

    name: str
    path: str
    original: str
    replacement: str
    #: pytest arguments: node ids or files, possibly ``-k EXPR``.
    tests: tuple[str, ...]
    #: The rule the break violates, in a few words.
    rule: str
    #: The drill's own check that the copy is what the tests import: must be caught.
    sanity: bool = False


def _m(name: str, path: str, original: str, replacement: str, rule: str, *tests: str) -> Mutation:
    return Mutation(name, path, original, replacement, tuple(tests), rule)


SANITY = Mutation(
    name="sanity-copy-is-imported",
    path="orders/validation.py",
    original='    return _check_text("user_id", value, max_length, key_safe=True)',
    replacement='    raise InvalidInput("user_id", "mutation drill sanity check")',
    tests=("tests/unit/test_domain.py::test_int_user_id_becomes_its_decimal_string",),
    rule="(the drill's own check: the tests import the mutated copy)",
    sanity=True,
)

MUTATIONS: tuple[Mutation, ...] = (
    SANITY,
    # --- admission in Redis (admit.lua) ------------------------------------------------------
    _m(
        "admit-limit-off-by-one",
        "orders/lua/admit.lua",
        "if count >= limit then",
        "if count > limit then",
        "Redis refuses at the limit, not one past it",
        "tests/integration/test_create.py::test_refusal_at_the_limit_carries_count_and_retry_after_and_costs_one_redis_call_no_sql",
    ),
    _m(
        "admit-keeps-expired-members",
        "orders/lua/admit.lua",
        "redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[3])",
        "-- expired members kept",
        "expired orders stop counting in Redis without a sweep",
        "tests/integration/test_create.py::test_expired_orders_stop_counting_without_any_sweep",
    ),
    _m(
        "admit-retry-takes-a-second-slot",
        "orders/lua/admit.lua",
        "if existing then",
        "if false then",
        "a retry of the same order id takes no second slot",
        "tests/integration/test_create.py::test_retry_with_the_same_order_id_returns_the_same_order_and_takes_no_second_slot",
    ),
    _m(
        "admit-key-never-expires",
        "orders/lua/admit.lua",
        "redis.call('PEXPIREAT', key, string.format('%d', tonumber(last[2]) + margin))",
        "-- the key lives forever",
        "an abandoned user key expires a margin after its latest member",
        "tests/integration/test_create.py::test_the_users_key_expires_a_margin_after_its_latest_member",
    ),
    # --- the SQL guard -----------------------------------------------------------------------
    _m(
        "sql-guard-dropped",
        "orders/records.py",
        '            self.check_room(conn, uid, limit, now_ms, values["id"])',
        "            pass",
        "SQL counts again under the user's lock (Redis may have lost members)",
        "tests/integration/test_create.py::test_sql_guard_refuses_when_redis_lost_its_members_and_leaves_no_phantom",
    ),
    _m(
        "sql-guard-off-by-one",
        "orders/records.py",
        "if open_count >= limit:",
        "if open_count > limit:",
        "the SQL guard refuses at the limit, not one past it",
        "tests/integration/test_create.py::test_sql_guard_refuses_when_redis_lost_its_members_and_leaves_no_phantom",
    ),
    _m(
        "pg-user-lock-dropped",
        "orders/transactions.py",
        '                conn.execute(_PG_USER_LOCK, {"key": user_lock})',
        "                pass",
        "PostgreSQL: the guard's count-then-insert runs under a per-user advisory lock",
        "tests/concurrency/test_limit_under_contention.py::test_sql_guard_needs_the_per_user_lock_on_postgresql[postgresql]",
    ),
    _m(
        "open-at-includes-the-expiry-instant",
        "orders/models.py",
        "orders_table.c.expires_at_ms > now_ms",
        "orders_table.c.expires_at_ms >= now_ms",
        "an order stops being open at its expiry instant (strict pay at expires_at refused)",
        "tests/integration/test_transitions.py::test_strict_expiry_refuses_a_payment_at_exactly_expires_at",
    ),
    # --- admission: compensation, retries, conflicts, outage policy ---------------------------
    _m(
        "compensation-keeps-the-member",
        "orders/admission.py",
        "            self.release_after_commit(user_id, order_id)",
        "            pass",
        "a failed insert removes the member it admitted",
        "tests/integration/test_create.py::test_sql_failure_on_insert_removes_the_member_again",
        "tests/integration/test_create.py::test_sql_guard_refuses_when_redis_lost_its_members_and_leaves_no_phantom",
    ),
    _m(
        "outage-policy-ignored",
        "orders/admission.py",
        "            if not self.create_without_redis:",
        "            if False:",
        "Redis down refuses a create unless create_without_redis",
        "tests/integration/test_create.py::test_redis_down_refuses_creation_with_store_unavailable_and_writes_no_row",
    ),
    _m(
        "retry-after-computed-wrong",
        "orders/admission.py",
        "return max(0, earliest_ms - now_ms) / 1000",
        "return max(0, earliest_ms) / 1000",
        "retry_after_s is the time until the earliest open order frees its slot",
        "tests/integration/test_create.py::test_refusal_at_the_limit_carries_count_and_retry_after_and_costs_one_redis_call_no_sql",
    ),
    _m(
        "idempotent-retry-refused-at-the-limit",
        "orders/admission.py",
        "earlier = self.records.find(oid, now_ms) if caller_id else None",
        "earlier = None",
        "a retry of a known order id returns it, even at the limit",
        "tests/integration/test_create.py::test_retry_of_an_order_already_paid_returns_it_even_at_the_limit",
        "tests/integration/test_create.py::test_a_retry_at_the_limit_returns_the_order_it_retries",
    ),
    _m(
        "retry-ignores-the-redis-expiry",
        "orders/admission.py",
        'values = {**values, "expires_at_ms": admitted.score_ms}',
        "values = {**values}",
        "a retry after a crash finishes the order with the expiry Redis holds",
        "tests/integration/test_create.py::test_a_retry_after_a_crash_between_redis_and_sql_finishes_the_order_with_the_redis_expiry",
    ),
    _m(
        "conflict-not-raised-for-another-user",
        "orders/domain.py",
        "    if order.user_id != user_id:",
        "    if False:",
        "an order id of another user is an OrderConflict",
        "tests/integration/test_create.py::test_the_same_order_id_for_another_user_is_a_conflict_and_leaves_no_member",
    ),
    # --- transitions: compare-and-set and the outbox ------------------------------------------
    _m(
        "pay-cas-dropped",
        "orders/records.py",
        "conditions=[ORDER.id == order_id, open_at(now_ms) if strict else UNPAID_PREDICATE],",
        "conditions=[ORDER.id == order_id],",
        "pay is a compare-and-set on status = 'unpaid'",
        "tests/integration/test_transitions.py::test_paying_a_swept_order_raises_order_closed_with_status_closed",
        "tests/integration/test_transitions.py::test_cancel_then_pay_leaves_the_cancel_as_the_only_winner",
    ),
    _m(
        "cancel-cas-dropped",
        "orders/records.py",
        "conditions=[ORDER.id == order_id, UNPAID_PREDICATE],",
        "conditions=[ORDER.id == order_id],",
        "cancel is a compare-and-set on status = 'unpaid'",
        "tests/integration/test_transitions.py::test_cancelling_a_paid_order_raises_already_paid",
        "tests/integration/test_transitions.py::test_pay_then_cancel_leaves_the_payment_as_the_only_winner",
    ),
    _m(
        "strict-expiry-ignored",
        "orders/records.py",
        "open_at(now_ms) if strict else UNPAID_PREDICATE",
        "UNPAID_PREDICATE",
        "under strict_expiry a payment after expires_at is refused",
        "tests/integration/test_transitions.py::test_strict_expiry_refuses_a_late_payment_and_closes_the_order",
    ),
    _m(
        "strict-close-cas-dropped",
        "orders/records.py",
        "conditions=[ORDER.id == order_id, due_at(now_ms)],",
        "conditions=[ORDER.id == order_id],",
        "a refused strict payment closes only an unpaid, due order",
        "tests/integration/test_transitions.py::test_strict_expiry_refuses_a_late_payment_and_closes_the_order",
        "tests/integration/test_transitions.py::test_strict_expiry_repeat_payment_after_expiry_returns_the_paid_order_and_closes_nothing",
    ),
    _m(
        "late-payment-ref-dropped",
        "orders/service.py",
        'data = {"trigger": "late_payment", "payment_ref": ref}',
        'data = {"trigger": "late_payment"}',
        "the late-payment close event carries the payment_ref, for the refund",
        "tests/integration/test_transitions.py::test_strict_expiry_refuses_a_late_payment_and_closes_the_order",
    ),
    _m(
        "repeat-payment-with-same-ref-refused",
        "orders/service.py",
        "if order.status is OrderStatus.PAID and ref in (None, order.payment_ref):",
        "if order.status is OrderStatus.PAID and ref is None:",
        "paying again with the stored reference returns the order",
        "tests/integration/test_transitions.py::test_second_payment_with_same_ref_returns_the_order_without_a_second_event",
    ),
    _m(
        "transition-event-dropped",
        "orders/records.py",
        "            self.record(conn, [(row.id, row.user_id)], kind, now_ms, event_data)",
        "            pass",
        "every transition writes its event (outbox)",
        "tests/integration/test_events.py::test_events_come_in_commit_order_and_positions_advance",
    ),
    _m(
        "created-event-dropped",
        "orders/records.py",
        '            self.record(conn, [(values["id"], uid)], EventKind.CREATED, now_ms, None)',
        "            pass",
        "a create writes its created event (outbox)",
        "tests/integration/test_events.py::test_events_come_in_commit_order_and_positions_advance",
    ),
    _m(
        "created-event-outside-the-transaction",
        "orders/records.py",
        "            row = conn.execute(_INSERT_ORDER, dict(values)).one()",
        "            row = conn.execute(_INSERT_ORDER, dict(values)).one(); conn.commit()",
        "the order row and its event commit together",
        "tests/crash/test_crashes.py",
        "-k",
        "connection_dropped_during_the_create_transaction and order_events",
    ),
    _m(
        "sweep-events-outside-the-transaction",
        "orders/records.py",
        "                rows = conn.execute(close).all()",
        "                rows = conn.execute(close).all(); conn.commit()",
        "a sweep batch's closes and their events commit together",
        "tests/integration/test_sweep.py::test_batch_whose_event_insert_fails_leaves_its_orders_unpaid",
    ),
    _m(
        "member-kept-after-payment",
        "orders/service.py",
        "                self.admitter.release_after_commit(order.user_id, order.id)",
        "                pass",
        "a payment removes the order's member after the commit",
        "tests/integration/test_transitions.py::test_mark_paid_moves_unpaid_to_paid_in_sql_and_removes_the_redis_member",
    ),
    _m(
        "extend-an-expired-order",
        "orders/records.py",
        "                open_at(now_ms),\n",
        "                UNPAID_PREDICATE,\n",
        "extend_order refuses an order whose time is up",
        "tests/integration/test_events.py::test_extend_refuses_closed_paid_expired_and_too_long",
    ),
    _m(
        "extend-past-the-max-lifetime",
        "orders/records.py",
        "ORDER.expires_at_ms + extra_ms - ORDER.created_at_ms <= max_life_ms,",
        "ORDER.expires_at_ms + extra_ms - ORDER.created_at_ms <= 2 * max_life_ms,",
        "no extension moves an expiry past created_at + max_lifetime_s",
        "tests/integration/test_events.py::test_extend_refuses_closed_paid_expired_and_too_long",
    ),
    # --- the sweep ---------------------------------------------------------------------------
    _m(
        "sweep-skips-orders-due-exactly-now",
        "orders/models.py",
        "orders_table.c.expires_at_ms <= cutoff_ms",
        "orders_table.c.expires_at_ms < cutoff_ms",
        "an order is due at its expiry instant",
        "tests/integration/test_sweep.py::test_sweep_closes_orders_due_at_or_before_now_and_keeps_later_ones",
    ),
    _m(
        "sweep-closes-orders-not-yet-due",
        "orders/sweep.py",
        "        cutoff = self.cutoff(now_ms)",
        "        cutoff = self.cutoff(now_ms) + 1",
        "the sweep never closes an order before its expiry",
        "tests/integration/test_sweep.py::test_sweep_closes_orders_due_at_or_before_now_and_keeps_later_ones",
    ),
    _m(
        "sweep-cutoff-ahead-of-the-clock",
        "orders/validation.py",
        "    if now_ms > clock_now:",
        "    if False:",
        "a sweep cutoff ahead of the clock is refused",
        "tests/integration/test_sweep.py::test_sweep_with_a_cutoff_ahead_of_the_clock_raises_and_closes_nothing",
    ),
    _m(
        "sweep-redis-cleanup-skipped",
        "orders/index.py",
        '                pipe.zremrangebyscore(self.key(user_id), "-inf", now_ms)',
        "                pass",
        "the sweep drops the closed orders' expired members",
        "tests/integration/test_sweep.py::test_sweep_closes_ten_due_orders_in_four_batches_of_three",
    ),
    _m(
        "sweep-skip-locked-removed",
        "orders/records.py",
        "due = due.with_for_update(skip_locked=True)",
        "due = due.with_for_update()",
        "PostgreSQL: a sweeper skips rows another holds, never waits on them",
        "tests/integration/test_sweep.py::test_sweep_skips_a_due_order_locked_by_another_transaction[postgresql]",
    ),
    # --- reconcile ---------------------------------------------------------------------------
    _m(
        "reconcile-removes-in-flight-members",
        "orders/reconciler.py",
        "remove = [(u, o) for u, o in extras if o in owners and owners[o] != u]",
        "remove = [(u, o) for u, o in extras if owners.get(o) != u]",
        "a member without a SQL row (a create in flight) stays until its expiry",
        "tests/integration/test_reconcile.py::test_a_member_without_a_sql_row_is_kept_until_its_own_expiry",
    ),
    _m(
        "reconcile-leaves-a-stale-add",
        "orders/reconciler.py",
        "            self._undo_stale_adds(added, now_ms)",
        "            pass",
        "an add racing a payment does not leave a stale member",
        "tests/integration/test_reconcile.py::test_an_add_that_races_a_payment_does_not_leave_a_stale_member",
    ),
    # --- the scheduler's lease ---------------------------------------------------------------
    _m(
        "lease-released-by-another-owner",
        "orders/lua/lease_release.lua",
        "if redis.call('GET', key) == ARGV[1] then",
        "if true then",
        "only the lease's owner can release it",
        "tests/integration/test_sweeper.py::test_lease_is_taken_by_one_owner_renewed_and_released_only_by_it",
        "tests/integration/test_sweeper.py::test_close_releases_our_lease_and_never_another_owners",
    ),
    _m(
        "lease-renewed-by-another-owner",
        "orders/lua/lease.lua",
        "if redis.call('GET', key) == owner then",
        "if true then",
        "only the lease's owner can renew it",
        "tests/integration/test_sweeper.py::test_lease_is_taken_by_one_owner_renewed_and_released_only_by_it",
    ),
    # --- input validation --------------------------------------------------------------------
    _m(
        "ttl-maximum-unchecked",
        "orders/validation.py",
        "    if ttl_s > max_ttl_ms / 1000:",
        "    if False:",
        "a TTL above the maximum (milliseconds by mistake) is refused",
        "tests/unit/test_domain.py::test_a_ttl_given_in_milliseconds_by_mistake_is_caught_by_the_maximum",
    ),
    _m(
        "user-id-key-unsafe-characters-allowed",
        "orders/validation.py",
        "        if key_safe and ch in KEY_UNSAFE:",
        "        if False:",
        "user ids may not contain {}*?[] (hash tags, glob patterns)",
        "tests/unit/test_domain.py::test_bad_user_ids_are_refused_without_echoing_them",
    ),
    # --- event consumers ---------------------------------------------------------------------
    _m(
        "consumer-cursor-not-saved",
        "orders/events.py",
        "                self._save_position(conn, event.position)",
        "                pass",
        "a consumer saves its position after each event",
        "tests/integration/test_event_retries.py::test_an_event_that_used_its_attempts_is_parked_logged_once_and_never_tried_again",
        "tests/integration/test_events.py::test_a_consumer_killed_mid_stream_resumes_without_losing_or_skipping_an_event",
    ),
    _m(
        "parked-events-retried",
        "orders/events.py",
        ".where(RC.consumer == self.name, RETRYING, RC.next_at_ms <= now_ms)",
        ".where(RC.consumer == self.name, RC.next_at_ms <= now_ms)",
        "a parked event is never retried until requeued",
        "tests/integration/test_event_retries.py::test_an_event_that_used_its_attempts_is_parked_logged_once_and_never_tried_again",
    ),
    _m(
        "park-one-attempt-late",
        "orders/events.py",
        "park = attempts >= self.max_attempts",
        "park = attempts > self.max_attempts",
        "an event is parked after max_attempts tries, not one more",
        "tests/integration/test_event_retries.py::test_max_attempts_one_parks_at_the_first_failure",
    ),
    _m(
        "pg-reader-passes-a-running-transaction",
        "orders/events.py",
        "        query = query.where(EC.txid < horizon)",
        "        query = query",
        "PostgreSQL: readers never pass an event of a transaction still running",
        "tests/integration/test_events.py::test_postgresql_readers_never_pass_an_event_of_a_transaction_still_running[postgresql]",
    ),
    # --- what the scheduler logs, and its rebuild beside the sweep ---------------------------
    _m(
        "summary-every-tick",
        "orders/sweep_log.py",
        "(not force and now - self._since < self.period_s)",
        "(not force and False)",
        "the scheduler's summary comes at most once per period",
        "tests/integration/test_sweeper.py::test_summary_comes_at_most_once_per_period_with_the_totals_since_the_last_one",
    ),
    _m(
        "backlog-clears-at-the-threshold",
        "orders/sweep_log.py",
        "if self._since is not None and lag_ms <= self.lag_ms // 2:",
        "if self._since is not None and lag_ms <= self.lag_ms:",
        "a backlog clears only well under its threshold (no line every tick near it)",
        "tests/integration/test_sweeper.py::test_backlog_is_logged_at_once_when_it_starts_and_once_when_it_clears",
    ),
    _m(
        "rebuild-does-not-yield-to-the-sweep",
        "orders/sweeper.py",
        "            if self._not_ticking.wait(REBUILD_WAIT_S):",
        "            if True:",
        "the index rebuild waits for a running sweep",
        "tests/integration/test_sweeper.py::test_rebuild_waits_for_a_running_tick_before_it_starts_and_between_its_chunks",
    ),
    # --- bounded stats, the self-healing embedded server ----------------------------------------
    _m(
        "stats-window-start-inclusive",
        "orders/stats.py",
        "return and_(column > self.since_ms, column <= self.until_ms)",
        "return and_(column >= self.since_ms, column <= self.until_ms)",
        "a stats window is open at its start and closed at its end",
        "tests/integration/test_stats.py::test_the_window_is_open_at_its_start_and_closed_at_its_end",
    ),
    _m(
        "embedded-server-not-restarted",
        "orders/embedded_client.py",
        "            if not self.restarter.restart():",
        "            if True:",
        "a process that finds its embedded redis-server dead starts it again",
        "tests/integration/test_embedded.py::test_a_command_in_flight_when_the_server_dies_completes_on_a_restarted_one",
        "tests/integration/test_embedded.py::test_a_stopped_server_comes_back_but_not_in_a_removed_home",
    ),
)


# --- checking the list against the source -------------------------------------------------------


def check_mutations(mutations: Sequence[Mutation], root: Path) -> list[str]:
    """Every reason the list cannot run as it stands (empty when it can)."""
    problems: list[str] = []
    seen: set[str] = set()
    for m in mutations:
        if m.name in seen:
            problems.append(f"{m.name}: the name is used twice")
        seen.add(m.name)
        if not m.tests:
            problems.append(f"{m.name}: no tests named")
        if m.original == m.replacement:
            problems.append(f"{m.name}: the replacement equals the original")
        for arg in m.tests:
            if arg.startswith("tests/") and not (root / arg.split("::")[0]).is_file():
                problems.append(f"{m.name}: no test file {arg.split('::')[0]}")
        source = root / m.path
        if not source.is_file():
            problems.append(f"{m.name}: no file {m.path}")
            continue
        found = source.read_text("utf-8").count(m.original)
        if found != 1:
            problems.append(
                f"{m.name}: {m.original.strip()!r} occurs {found} times in {m.path} "
                "(it must occur exactly once; update the mutation)"
            )
    return problems


def line_of(m: Mutation, root: Path) -> int:
    text = (root / m.path).read_text("utf-8")
    return text[: text.index(m.original)].count("\n") + 1


# --- the temporary copy ------------------------------------------------------------------------


def git(*args: str) -> str:
    exe = shutil.which("git")
    if exe is None:
        raise SystemExit("mutation drill: git not found")
    done = subprocess.run([exe, "-C", str(REPO), *args], capture_output=True, text=True, check=True)
    return done.stdout


def copy_checkout(target: Path) -> None:
    """The checkout's files as they are on disk (tracked, and untracked but not ignored)."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in sorted({n for n in listed if n}):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        dest = target / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), dest)
        else:
            shutil.copy2(source, dest)


def child_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(copy), env.get("PYTHONPATH")) if p)
    # Never a stale .pyc: a mutation and its undo can keep a file's size and mtime second.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    env["COLUMNS"] = "400"  # the short summary keeps the failure's reason on its line
    return env


def check_imports(copy: Path) -> None:
    """Python in the copy must import ``orders`` (and its Lua) and ``tests`` from the copy."""
    probe = (
        "import importlib.resources, orders, tests.helpers\n"
        "print(orders.__file__)\n"
        "print(importlib.resources.files('orders').joinpath('lua', 'admit.lua'))\n"
        "print(tests.helpers.REPO / 'tests')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=copy,
        env=child_env(copy),
        capture_output=True,
        text=True,
        check=False,
    )
    paths = done.stdout.split()
    real = copy.resolve()
    if done.returncode != 0 or len(paths) != 3:
        raise SystemExit(f"mutation drill: cannot import from the copy:\n{done.stderr}")
    for path in paths:
        if not Path(path).resolve().is_relative_to(real):
            raise SystemExit(
                f"mutation drill: {path} is imported from outside the copy {copy}; "
                "the mutations would not be tested"
            )


# --- running pytest ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """A mutation's result (or the baseline's)."""

    mutation: Mutation | None
    status: str  # caught, survived, timeout, error (baseline: passed, failed, ...)
    seconds: float
    failed: list[str] = field(default_factory=list)
    output: str = ""


_FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S.*?)(?: - (.*))?$", re.MULTILINE)


class Runner:
    """Runs pytest in one copy; keeps track of the child so an interrupt can stop it."""

    children: ClassVar[set[subprocess.Popen[str]]] = set()
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, copy: Path, timeout_s: float) -> None:
        self.copy = copy
        self.timeout_s = timeout_s
        self.env = child_env(copy)

    def pytest(self, args: Sequence[str]) -> tuple[int | None, str, float]:
        """(exit status or None on timeout, output, seconds)."""
        basetemp = self.copy.parent / f"{self.copy.name}-pytest"
        command = [
            sys.executable, "-m", "pytest", *PYTEST_FLAGS, f"--basetemp={basetemp}", *args
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(
            command,
            cwd=self.copy,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: an interrupt stops all of it
        )
        with Runner.lock:
            Runner.children.add(proc)
        try:
            try:
                output, _ = proc.communicate(timeout=self.timeout_s)
                status: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                stop_group(proc)
                output, _ = proc.communicate()
                status = None
        finally:
            with Runner.lock:
                Runner.children.discard(proc)
        return status, output, time.monotonic() - started

    @classmethod
    def stop_all(cls) -> None:
        with cls.lock:
            running = list(cls.children)
        for proc in running:
            stop_group(proc)


def stop_group(proc: subprocess.Popen[str]) -> None:
    """Stop a pytest we started and its children: SIGINT (finalizers run), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(INTERRUPT_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def failed_tests(output: str) -> list[str]:
    found = []
    for node, reason in _FAILED_LINE.findall(output):
        why = " ".join(reason.split())[:100]
        found.append(f"{node} ({why})" if why else node)
    return found


@contextmanager
def mutated(copy: Path, m: Mutation) -> Iterator[None]:
    """The copy with ``m`` applied; the original text is back afterwards."""
    path = copy / m.path
    original = path.read_text("utf-8")
    if original.count(m.original) != 1:
        raise RuntimeError(f"{m.name}: the copy's {m.path} does not match the checkout")
    path.write_text(original.replace(m.original, m.replacement), "utf-8")
    try:
        yield
    finally:
        path.write_text(original, "utf-8")


def run_mutation(runner: Runner, m: Mutation) -> Outcome:
    with mutated(runner.copy, m):
        status, output, seconds = runner.pytest(m.tests)
    failed = failed_tests(output)
    if status is None:
        verdict = "timeout"
    elif status == 0:
        verdict = "survived"
    elif status == 1 and failed:
        verdict = "caught"
    else:  # 2 interrupted or collection error, 3 internal error, 4 usage, 5 nothing collected
        verdict = "error"
    return Outcome(m, verdict, seconds, failed[:FAILED_SHOWN], output)


def baseline_selections(mutations: Sequence[Mutation]) -> list[tuple[str, ...]]:
    """The selected tests as few pytest runs: node ids together, each ``-k`` run alone."""
    plain: dict[str, None] = {}
    keyed: dict[tuple[str, ...], None] = {}
    for m in mutations:
        if "-k" in m.tests:
            keyed[m.tests] = None
        else:
            plain.update(dict.fromkeys(m.tests))
    return ([tuple(plain)] if plain else []) + list(keyed)


def run_baseline(runner: Runner, mutations: Sequence[Mutation]) -> Outcome:
    """Every selected test, unmutated: they must pass for a failure to mean anything."""
    total = 0.0
    for args in baseline_selections(mutations):
        status, output, seconds = runner.pytest(args)
        total += seconds
        if status != 0:
            verdict = "timeout" if status is None else f"failed (exit {status})"
            return Outcome(None, verdict, total, failed_tests(output), output)
    return Outcome(None, "passed", total)


# --- reporting --------------------------------------------------------------------------------


def commit_label() -> str:
    head = git("rev-parse", "--short=12", "HEAD").strip()
    dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    return f"{head} (with uncommitted changes)" if dirty else head


def cell(text: str) -> str:
    """Plain text for a table cell: no column breaks, no HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def failure_cell(failed: Sequence[str]) -> str:
    """The first failed node id as code, then its reason."""
    if not failed:
        return "-"
    node, _, reason = failed[0].partition(" (")
    return f"`{node}`" + (f" ({cell(reason)}" if reason else "")


def write_markdown(
    path: Path, outcomes: Sequence[Outcome], baseline: Outcome, started_at: datetime, wall_s: float
) -> None:
    real = [o for o in outcomes if o.mutation is not None and not o.mutation.sanity]
    counts = {s: sum(1 for o in real if o.status == s) for s in ("caught", "survived")}
    other = len(real) - counts["caught"] - counts["survived"]
    lines = [
        "# Mutation drill",
        "",
        "Generated by `scripts/mutation_drill.py`; do not edit by hand. Each row breaks one",
        "rule with a one-line change in a temporary copy of the tree, runs only the tests named",
        "for it, and records which failed. Every break must be caught.",
        "",
        f"- date: {started_at:%Y-%m-%d %H:%M} UTC",
        f"- commit: `{commit_label()}`",
        f"- python: {sys.version.split()[0]}, {os.cpu_count()} cores",
        f"- totals: {len(real)} mutations, {counts['caught']} caught, "
        f"{counts['survived']} survived, {other} timed out or could not run",
        f"- baseline (the selected tests, unmutated): {baseline.status} "
        f"in {baseline.seconds:.0f} s",
        f"- wall time: {wall_s:.0f} s",
        "",
        "Run it with `.venv/bin/python scripts/mutation_drill.py` (`--list`, `--only NAME,...`).",
        "",
        "| mutation | where | rule it breaks | result | first failed test | s |",
        "| --- | --- | --- | --- | --- | ---: |",
    ]
    for o in outcomes:
        m = o.mutation
        assert m is not None
        where = f"`{m.path}:{line_of(m, REPO)}`"
        first = failure_cell(o.failed)
        lines.append(
            f"| {m.name} | {where} | {cell(m.rule)} | {o.status} | {first} | {o.seconds:.1f} |"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text("\n".join(lines) + "\n", "utf-8")
    partial.replace(path)


def print_list(mutations: Sequence[Mutation]) -> None:
    for m in mutations:
        print(f"{m.name}\n    {m.path}:{line_of(m, REPO)}  {m.original.strip()!r}")
        print(f"    -> {m.replacement.strip()!r}\n    tests: {' '.join(m.tests)}")


def report_line(index: int, total: int, o: Outcome) -> str:
    assert o.mutation is not None
    first = f"  {o.failed[0]}" if o.failed else ""
    return f"[{index:2}/{total}] {o.mutation.name:42} {o.status:8} {o.seconds:6.1f} s{first}"


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", help="comma-separated mutation names (the sanity one runs too)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once (default 1)")
    parser.add_argument(
        "--markdown",
        type=Path,
        help=f"results file (default {DEFAULT_MARKDOWN}; written by full runs, or when given)",
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutation's tests"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of the selected tests"
    )
    return parser.parse_args(argv)


def select(only: str | None) -> list[Mutation]:
    if not only:
        return list(MUTATIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {m.name for m in MUTATIONS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"mutation drill: no mutation named {', '.join(unknown)} (see --list)")
    return [m for m in MUTATIONS if m.sanity or m.name in names]


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def prepare(mutations: Sequence[Mutation], args: argparse.Namespace, temp: Path) -> list[Runner]:
    """One copy per job; checks that the copy is imported and that the sanity mutation fails."""
    copies = []
    for n in range(max(1, args.jobs)):
        copy = temp / f"copy-{n}"
        copy_checkout(copy)
        copies.append(copy)
    check_imports(copies[0])
    return [Runner(copy, args.timeout) for copy in copies]


def run_all(runners: Sequence[Runner], mutations: Sequence[Mutation]) -> dict[str, Outcome]:
    """Each mutation on the first free copy; results by name, printed as they come."""
    outcomes: dict[str, Outcome] = {}
    free = list(runners)
    free_lock = threading.Lock()

    def job(m: Mutation) -> Outcome:
        with free_lock:
            runner = free.pop()
        try:
            return run_mutation(runner, m)
        finally:
            with free_lock:
                free.append(runner)

    with ThreadPoolExecutor(max_workers=len(runners)) as pool:
        futures = [pool.submit(job, m) for m in mutations]
        try:
            for done, future in enumerate(as_completed(futures), start=1):
                outcome = future.result()
                assert outcome.mutation is not None
                outcomes[outcome.mutation.name] = outcome
                print(report_line(done, len(mutations), outcome), flush=True)
        except BaseException:
            for future in futures:
                future.cancel()
            Runner.stop_all()
            raise
    return outcomes


def summarize(ordered: Sequence[Outcome], wall_s: float) -> list[Outcome]:
    """Print the totals and every mutation not caught; returns those."""
    bad = [o for o in ordered if o.status != "caught"]
    print(f"\n{len(ordered) - len(bad)} of {len(ordered)} mutations caught in {wall_s:.0f} s")
    for o in bad:
        assert o.mutation is not None
        print(f"  {o.status}: {o.mutation.name} ({' '.join(o.mutation.tests)})")
        if o.status != "survived":
            print(o.output[-2000:])
    return bad


def drill(mutations: list[Mutation], args: argparse.Namespace, temp: Path) -> int:
    started_at = datetime.now(UTC)
    started = time.monotonic()
    runners = prepare(mutations, args, temp)
    print(f"mutation drill: {len(mutations) - 1} mutations, copies in {temp}", flush=True)
    sanity = run_mutation(runners[0], SANITY)
    print(report_line(0, len(mutations) - 1, sanity), flush=True)
    if sanity.status != "caught":
        print(sanity.output[-3000:], file=sys.stderr)
        print("mutation drill: the sanity mutation was not caught: the tests do not run the "
              "mutated copy", file=sys.stderr)  # fmt: skip
        return 2
    rest = [m for m in mutations if not m.sanity]
    baseline = Outcome(None, "skipped", 0.0)
    if not args.no_baseline:
        baseline = run_baseline(runners[0], rest)
        print(f"baseline: {baseline.status} in {baseline.seconds:.1f} s", flush=True)
        if baseline.status != "passed":
            print(baseline.output[-5000:], file=sys.stderr)
            print("mutation drill: the selected tests fail without any mutation", file=sys.stderr)
            return 2
    outcomes = run_all(runners, rest)
    ordered = [outcomes[m.name] for m in rest]
    wall_s = time.monotonic() - started
    bad = summarize(ordered, wall_s)
    markdown = args.markdown or (None if args.only else DEFAULT_MARKDOWN)
    if markdown is not None:
        target = markdown if markdown.is_absolute() else REPO / markdown
        write_markdown(target, [sanity, *ordered], baseline, started_at, wall_s)
        print(f"results written to {target}")
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mutations = select(args.only)
    problems = check_mutations(mutations, REPO)
    if problems:
        print("mutation drill: the list does not match the source:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    if args.list:
        print_list(mutations)
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    temp = Path(tempfile.mkdtemp(prefix="orders-mutation-drill-"))
    try:
        return drill(mutations, args, temp)
    except KeyboardInterrupt:
        Runner.stop_all()
        print("\nmutation drill: interrupted; the working tree is untouched", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
