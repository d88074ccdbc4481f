"""The mutation drill's list: each named one-line break of a rule, and the tests that must
catch it (the runner is ``scripts/mutation_drill.py``).

A mutation names a file, an exact fragment of it, its replacement, the rule it breaks and the
tests that must fail. :func:`check_mutations` refuses a list whose fragment no longer occurs
exactly once, so moved code makes the drill stop and say so instead of testing nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


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


def mutation(
    name: str, path: str, original: str, replacement: str, rule: str, *tests: str
) -> Mutation:
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

RECONCILE_PLANS = "tests/integration/test_reconcile_plans.py"

#: The breaks of the stores' rules: admission, the SQL guard, transitions (the processes'
#: are in drill_mutations_processes.py).
STORE_MUTATIONS: tuple[Mutation, ...] = (
    SANITY,
    # --- admission in Redis (admit.lua) ------------------------------------------------------
    mutation(
        "admit-limit-off-by-one",
        "orders/index/lua/admit.lua",
        "if count >= limit then",
        "if count > limit then",
        "Redis refuses at the limit, not one past it",
        "tests/integration/test_create.py::test_refusal_at_the_limit_carries_count_and_retry_after_and_costs_one_redis_call_no_sql",
    ),
    mutation(
        "admit-keeps-expired-members",
        "orders/index/lua/admit.lua",
        "redis.call('ZCOUNT', key, '(' .. ARGV[3], '+inf')",
        "redis.call('ZCOUNT', key, '-inf', '+inf')",
        "expired orders stop counting in Redis without a sweep",
        "tests/integration/test_create.py::test_expired_orders_stop_counting_without_any_sweep",
    ),
    mutation(
        "admit-retry-takes-a-second-slot",
        "orders/index/lua/admit.lua",
        "if existing and tonumber(existing) > now then",
        "if false then",
        "a retry of the same order id takes no second slot",
        "tests/integration/test_create.py::test_retry_with_the_same_order_id_returns_the_same_order_and_takes_no_second_slot",
    ),
    mutation(
        "admit-keeps-an-old-key-expiry",
        "orders/index/lua/admit.lua",
        "redis.call('PERSIST', key)",
        "-- an expiry set before is kept",
        "a key expiry left from before is cleared when a member is added (it would take it)",
        "tests/integration/test_index_keys.py::test_an_expiry_left_from_before_is_cleared_when_a_member_is_added",
    ),
    mutation(
        "admit-rate-off-by-one",
        "orders/index/lua/admit.lua",
        "if made >= rate then",
        "if made > rate then",
        "Redis refuses the create past the rate, not one more",
        "tests/integration/test_create_rate.py::test_the_creates_past_the_rate_are_refused_until_the_oldest_leaves_the_window",
    ),
    mutation(
        "admit-rate-window-holds-its-first-millisecond",
        "orders/index/lua/admit.lua",
        "redis.call('ZCOUNT', rate_key, '(' .. since, '+inf')",
        "redis.call('ZCOUNT', rate_key, since, '+inf')",
        "a create leaves the rate's window exactly one window after it started",
        "tests/integration/test_create_rate.py::test_the_creates_past_the_rate_are_refused_until_the_oldest_leaves_the_window",
    ),
    mutation(
        "compensation-keeps-the-rate-entry",
        "orders/index/unpaid.py",
        "pipe.zrem(self.rate_key(user_id), order_id)",
        "pipe.zrem(self.rate_key(user_id), '')",
        "a create refused by SQL after Redis admitted it does not use up the rate",
        "tests/integration/test_create_rate.py::test_a_create_refused_by_sql_after_redis_admitted_gives_its_rate_back",
    ),
    # --- the SQL guard -----------------------------------------------------------------------
    mutation(
        "sql-guard-dropped",
        "orders/sql/slots.py",
        ".where(candidates.c.n <= limit, ~taken, ~over_limit)",
        ".where(candidates.c.n <= limit, ~over_limit)",
        "a create takes a slot no unpaid order of the user holds",
        "tests/integration/test_create.py::test_sql_guard_refuses_when_redis_lost_its_members_and_leaves_no_phantom",
        "tests/integration/test_create.py::test_expired_orders_stop_counting_without_any_sweep",
    ),
    mutation(
        "sql-guard-off-by-one",
        "orders/sql/slots.py",
        "candidates.c.n <= limit,",
        "candidates.c.n <= 1 + limit,",
        "the slots are 1..limit, not one more",
        "tests/integration/test_create.py::test_sql_guard_refuses_when_redis_lost_its_members_and_leaves_no_phantom",
    ),
    mutation(
        "slot-of-an-expired-order-not-taken",
        "orders/sql/slots.py",
        "                CLOSE_EXPIRED.run(conn, "
        '{"oid": order_id, "now_ms": now_ms}, SLOT_REUSE, actor)',
        "                pass",
        "a create closes the expired, unswept holder of a slot to take it",
        "tests/integration/test_create.py::test_expired_orders_stop_counting_without_any_sweep",
    ),
    mutation(
        "open-at-includes-the-expiry-instant",
        "orders/sql/predicates.py",
        "orders_table.c.expires_at_ms > now_ms",
        "orders_table.c.expires_at_ms >= now_ms",
        "an order stops being open at its expiry instant (an extension at expires_at refused;"
        " SQL's open orders and the rebuild leave it out)",
        "tests/integration/test_events.py::test_extend_at_exactly_expires_at_is_refused_and_one_ms_before_is_not",
        "tests/integration/test_reconcile.py::test_at_an_orders_expiry_instant_sql_no_longer_counts_it_nor_restores_its_member",
    ),
    # --- admission: compensation, retries, conflicts, outage policy ---------------------------
    mutation(
        "compensation-keeps-the-member",
        "orders/rules/admission.py",
        "existing.is_open):\n"
        "            self.followups.release_after_commit(user_id, order_id, forget_admission=True)",
        "existing.is_open):\n            pass",
        "a failed insert removes the member it admitted",
        "tests/integration/test_create.py::test_sql_failure_on_insert_removes_the_member_again",
        "tests/integration/test_create.py::test_sql_guard_refuses_when_redis_lost_its_members_and_leaves_no_phantom",
    ),
    mutation(
        "outage-policy-ignored",
        "orders/rules/admission.py",
        "            if not self.create_without_redis:",
        "            if False:",
        "Redis down refuses a create unless create_without_redis",
        "tests/integration/test_create.py::test_redis_down_refuses_creation_with_store_unavailable_and_writes_no_row",
    ),
    mutation(
        "retry-after-computed-wrong",
        "orders/rules/admission.py",
        "return max(0, earliest_ms - now_ms) / 1000",
        "return max(0, earliest_ms) / 1000",
        "retry_after_s is the time until the earliest open order frees its slot",
        "tests/integration/test_create.py::test_refusal_at_the_limit_carries_count_and_retry_after_and_costs_one_redis_call_no_sql",
    ),
    mutation(
        "idempotent-retry-refused-at-the-limit",
        "orders/rules/admission.py",
        "earlier = self.records.find(new.id, now_ms, host) if new.caller_id else None",
        "earlier = None",
        "a retry of a known order id returns it, even at the limit",
        "tests/integration/test_create.py::test_retry_of_an_order_already_paid_returns_it_even_at_the_limit",
        "tests/integration/test_create.py::test_a_retry_at_the_limit_returns_the_order_it_retries",
    ),
    mutation(
        "retry-ignores-the-redis-expiry",
        "orders/rules/admission.py",
        "new = replace(new, expires_at_ms=admitted.score_ms)",
        "new = replace(new)",
        "a retry after a crash finishes the order with the expiry Redis holds",
        "tests/integration/test_create.py::test_a_retry_after_a_crash_between_redis_and_sql_finishes_the_order_with_the_redis_expiry",
    ),
    mutation(
        "conflict-not-raised-for-another-user",
        "orders/domain.py",
        "        if order.user_id != self.user_id:",
        "        if False:",
        "an order id of another user is an OrderConflict",
        "tests/integration/test_create.py::test_the_same_order_id_for_another_user_is_a_conflict_and_leaves_no_member",
    ),
    # --- transitions: compare-and-set and the outbox ------------------------------------------
    mutation(
        "pay-cas-dropped",
        "orders/sql/transitions.py",
        "PAY = CompareAndSet(EventKind.PAID, _update([UNPAID_PREDICATE], _PAID), SELL)",
        "PAY = CompareAndSet(EventKind.PAID, _update([], _PAID), SELL)",
        "pay is a compare-and-set on status = 'unpaid'",
        "tests/integration/test_transitions.py::test_paying_a_cancelled_or_swept_order_raises_order_closed_and_records_the_refusal",
        "tests/integration/test_transitions.py::test_cancel_then_pay_leaves_the_cancel_as_the_only_winner",
    ),
    mutation(
        "cancel-cas-dropped",
        "orders/sql/transitions.py",
        "        [UNPAID_PREDICATE],\n        {\n"
        '            "status": OrderStatus.CANCELLED.value,',
        '        [],\n        {\n            "status": OrderStatus.CANCELLED.value,',
        "cancel is a compare-and-set on status = 'unpaid'",
        "tests/integration/test_transitions.py::test_cancelling_a_paid_order_raises_already_paid",
        "tests/integration/test_transitions.py::test_pay_then_cancel_leaves_the_payment_as_the_only_winner",
    ),
    mutation(
        "strict-expiry-ignored",
        "orders/sql/transitions.py",
        "_update([UNPAID_PREDICATE, or_(open_at(_NOW), PAUSED)], _PAID)",
        "_update([UNPAID_PREDICATE], _PAID)",
        "under strict_expiry a payment after expires_at is refused",
        "tests/integration/test_transitions.py::test_strict_expiry_refuses_a_late_payment_and_closes_the_order",
    ),
    # The close a refused strict payment makes is CLOSE_EXPIRED (closable_at: unpaid, due,
    # no pause open), the same statement a create uses to take an expired holder's slot.
    mutation(
        "strict-close-cas-dropped",
        "orders/sql/transitions.py",
        "        [closable_at(_NOW)],\n",
        "        [],\n",
        "a refused strict payment closes only an unpaid, due order",
        "tests/integration/test_transitions.py::test_strict_expiry_refuses_a_late_payment_and_closes_the_order",
        "tests/integration/test_transitions.py::test_strict_expiry_repeat_payment_after_expiry_returns_the_paid_order_and_closes_nothing",
    ),
    mutation(
        "late-payment-ref-dropped",
        "orders/rules/payments.py",
        'data = {"trigger": "late_payment", "payment_ref": payment.ref}',
        'data = {"trigger": "late_payment"}',
        "the late-payment close event carries the payment_ref, for the refund",
        "tests/integration/test_transitions.py::test_strict_expiry_refuses_a_late_payment_and_closes_the_order",
    ),
    mutation(
        "repeat-payment-with-same-ref-refused",
        "orders/rules/payments.py",
        "if payment.ref is None or payment.ref == order.payment_ref:",
        "if payment.ref is None:",
        "paying again with the stored reference returns the order",
        "tests/integration/test_transitions.py::test_second_payment_with_same_ref_returns_the_order_without_a_second_event",
    ),
    mutation(
        "transition-event-dropped",
        "orders/sql/transitions.py",
        "            conn.execute(_INSERT_EVENT, event)",
        "            pass",
        "every transition writes its event (outbox)",
        "tests/integration/test_events.py::test_events_come_in_commit_order_and_positions_advance",
    ),
    mutation(
        "transition-event-dropped-postgresql",
        "orders/sql/transitions.py",
        "    return select(changed).add_cte(record)",
        "    return select(changed)",
        "every transition writes its event (outbox), also in PostgreSQL's one statement",
        "tests/integration/test_events.py::test_events_come_in_commit_order_and_positions_advance",
    ),
    mutation(
        "created-event-dropped-postgresql",
        "orders/sql/slots.py",
        '    return with_events(returned, "created", EventKind.CREATED, created_at, data)',
        "    return returned",
        "a create writes its created event (outbox), also in PostgreSQL's one statement",
        "tests/integration/test_events.py::test_events_come_in_commit_order_and_positions_advance",
    ),
    mutation(
        "idle-connections-not-pinged",
        "orders/sql/engine.py",
        "            engine.dialect.do_ping(dbapi_connection)",
        "            pass",
        "a pooled connection that sat idle is pinged and replaced before use",
        "tests/integration/test_pool_ping.py",
    ),
    mutation(
        "created-event-dropped",
        "orders/sql/slots.py",
        "                    record_events(\n"
        "                        conn, created, EventKind.CREATED, "
        "new.created_at_ms, new.trace, new.actor\n"
        "                    )",
        "                    pass",
        "a create writes its created event (outbox)",
        "tests/integration/test_events.py::test_events_come_in_commit_order_and_positions_advance",
    ),
    mutation(
        "created-event-outside-the-transaction",
        "orders/sql/slots.py",
        "                row = conn.execute(self._insert, params).one_or_none()",
        "                row = conn.execute(self._insert, params).one_or_none(); conn.commit()",
        "the order row and its event commit together",
        "tests/crash/test_crashes.py",
        "-k",
        "connection_dropped_during_the_create_transaction and order_events",
    ),
    mutation(
        "sweep-events-outside-the-transaction",
        "orders/sql/closing.py",
        "            rows = conn.execute(statement, params).all()",
        "            rows = conn.execute(statement, params).all(); conn.commit()",
        "a sweep batch's closes and their events commit together",
        "tests/integration/test_sweep.py::test_batch_whose_event_insert_fails_leaves_its_orders_unpaid",
    ),
    # The release after a commit is Transitioner.run's default for every transition: the
    # payment's own break is its call opting out of it.
    mutation(
        "member-kept-after-payment",
        "orders/rules/payments.py",
        "order, won = self.transitioner.run(order_id, now_ms, attempt, host=host)",
        "order, won = self.transitioner.run("
        "order_id, now_ms, attempt, redis_after=_nothing, host=host)",
        "a payment removes the order's member after the commit",
        "tests/integration/test_transitions.py::test_mark_paid_moves_unpaid_to_paid_in_sql_and_removes_the_redis_member",
    ),
    mutation(
        "extend-an-expired-order",
        "orders/sql/transitions.py",
        "            open_at(_NOW),\n            ORDER.expires_at_ms + _EXTRA",
        "            UNPAID_PREDICATE,\n            ORDER.expires_at_ms + _EXTRA",
        "extend_order refuses an order whose time is up",
        "tests/integration/test_events.py::test_extend_refuses_closed_paid_expired_and_too_long",
    ),
    mutation(
        "extend-past-the-max-lifetime",
        "orders/sql/transitions.py",
        '            <= bindparam("max_life_ms", type_=BigInteger),',
        '            <= 2 * bindparam("max_life_ms", type_=BigInteger),',
        "no extension moves an expiry past created_at + max_lifetime_s",
        "tests/integration/test_events.py::test_extend_refuses_closed_paid_expired_and_too_long",
    ),
    # Reconcile's reads are bound by the open orders: planned beside 10**6 closed ones, as
    # the driver's prepared statements are (PostgreSQL's generic plan; SQLite plans the
    # bound values, so it keeps the partial index through both breaks).
    mutation(
        "reconcile-page-without-its-user-bound",
        "orders/sql/reconcile_reads.py",
        '        ORDER.user_id >= bindparam("after_user"),',
        "        ORDER.user_id.is_not(None),",
        "each reconcile page starts its scan of the per-user unpaid index at the last page's end",
        RECONCILE_PLANS,
    ),
    mutation(
        "reconcile-page-status-as-parameter",
        "orders/sql/reconcile_reads.py",
        '        open_at(bindparam("now_ms")),\n        ORDER.user_id >= bindparam("after_user"),',
        '        ORDER.status == bindparam("unpaid", "unpaid"),'
        ' ORDER.expires_at_ms > bindparam("now_ms"),\n'
        '        ORDER.user_id >= bindparam("after_user"),',
        "a reconcile page reads the partial index over unpaid orders, never the table",
        RECONCILE_PLANS,
    ),
    mutation(
        "epoch-marker-names-the-run-after-the-rebuild",
        "orders/rules/reconcile.py",
        "self.index.epoch.set(str(now_ms), runs)",
        "self.index.epoch.set(str(now_ms))",
        "a Redis restarted during a rebuild is rebuilt again: the marker names the runs read "
        "before the rebuild began",
        "tests/crash/test_redis_rewound.py::test_a_redis_restarted_during_a_rebuild_is_rebuilt_again_at_the_next_check",
    ),
    # --- creates that died: a refusal's suspects (issue 46) --------------------------------
    mutation(
        "refusal-names-no-suspects",
        "orders/index/lua/admit.lua",
        "if start and start > 0 and start <= settled then",
        "if false then",
        "a create that died stops refusing its user, from any process, seconds after its start",
        "tests/crash/test_stalled_redis.py::test_another_process_admits_the_user_once_a_create_failed_in_a_stall_is_seconds_old[redis7.0-sqlite]",
        "tests/crash/test_stalled_redis.py::test_another_process_admits_the_user_once_a_create_failed_in_a_stall_is_seconds_old[redis7.0-postgresql]",
    ),
    mutation(
        "suspect-check-ignores-the-in-flight-lock",
        "orders/sql/inflight.py",
        'free = {oid for oid, got in conn.execute(_TRY_LOCKS, {"ids": ids}) if got}',
        'free = {oid for oid, got in conn.execute(_TRY_LOCKS, {"ids": ids}) if True}',
        "PostgreSQL: a create whose transaction is still open is not taken for dead",
        "tests/integration/test_host_transaction.py::test_a_refusal_keeps_the_member_of_a_create_whose_host_transaction_is_still_open[redis7.0-postgresql]",
    ),
    mutation(
        "suspect-check-ignores-the-sqlite-write-lock",
        "orders/sql/inflight.py",
        "if not _write_lock(conn):",
        "if not (_write_lock(conn) or True):",
        "SQLite: a create whose transaction is still open is not taken for dead",
        "tests/integration/test_host_transaction.py::test_a_refusal_keeps_the_member_of_a_create_whose_host_transaction_is_still_open[redis7.0-sqlite]",
    ),
    mutation(
        "suspects-never-confirmed",
        "orders/rules/abandoning.py",
        "self.index.confirm(user_id, fates.committed)",
        "pass",
        "a refusal asks SQL about a committed order once, then costs one round trip again",
        "tests/integration/test_create.py::test_a_refusal_asks_sql_once_about_admissions_seconds_old_then_costs_one_redis_call_again[redis7.0-postgresql-sync-server]",
    ),
    mutation(
        "reconcile-keeps-dead-creates-in-flight",
        "orders/rules/reconcile.py",
        "abandoned += [member for member in suspects if member[1] in fates.dead]",
        "abandoned += []",
        "reconcile does not keep a create SQL knows dead as in flight",
        "tests/crash/test_stalled_redis.py::test_a_leftover_no_compensation_reached_goes_at_reconcile_once_seconds_old[redis7.0-postgresql]",
        "tests/crash/test_host_transaction_crash.py::test_create_killed_in_its_host_transaction_frees_its_users_slot_seconds_after_its_start[redis7.0-sqlite-create-commit]",
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
