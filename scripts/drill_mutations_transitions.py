"""The mutation drill's list, second half of the stores' rules: transitions (compare-and-set
and the outbox), the sweep, reconcile and the creates that died (what a mutation is:
drill_mutations.py; the runner joins the parts in drill_mutations_processes.py). Kept apart
so that each list stays a readable length.
"""

from __future__ import annotations

from drill_mutations import RECONCILE_PLANS, Mutation, mutation

TRANSITION_MUTATIONS: tuple[Mutation, ...] = (
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
    # no pause open); a create's slot reuse closes several at once with CLOSE_ALL_EXPIRED.
    mutation(
        "strict-close-cas-dropped",
        "orders/sql/transitions.py",
        "_update([closable_at(_NOW)], _CLOSED), RELEASE)",
        "_update([], _CLOSED), RELEASE)",
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
        "slot-reuse-close-cas-dropped",
        "orders/sql/transitions.py",
        "_update([closable_at(_NOW)], _CLOSED, ORDER.id.in_(_OIDS))",
        "_update([], _CLOSED, ORDER.id.in_(_OIDS))",
        "a create's slot reuse closes only orders still unpaid and due when it runs",
        "tests/integration/test_create.py::test_a_holder_paid_while_a_create_closes_due_holders_stays_paid",
    ),
    mutation(
        "transition-event-dropped",
        "orders/sql/transitions.py",
        "        insert_event_rows(conn, events)",
        "        pass",
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
        "            row = self._insert_row(conn, new)",
        "            row = self._insert_row(conn, new); conn.commit()",
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
        "self.index.confirm([(user_id, order_id) for order_id in fates.committed])",
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
