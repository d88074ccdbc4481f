"""The mutation drill's list: the breaks of the combined paths (``ORDERS_COMBINE_CREATES``,
``ORDERS_COMBINE_TRANSITIONS``), where concurrent calls share one transaction. What a
mutation is: drill_mutations.py.
"""

from __future__ import annotations

from drill_mutations import Mutation, mutation

COMBINED_MUTATIONS: tuple[Mutation, ...] = (
    # --- combined creates: the batch's inserts on the driver ---------------------------------
    mutation(
        "combined-create-row-not-converted",
        "orders/sql/slot_batch.py",
        "                    row[name] = process(row[name])",
        "                    pass",
        "a combined create on SQLite returns its order as SQLAlchemy would read it (metadata JSON)",
        "tests/concurrency/test_combined_creates.py::test_creates_for_distinct_users_share_batches_and_each_gets_its_own_order",
    ),
    mutation(
        "combined-create-event-time-lost",
        "orders/sql/slot_batch.py",
        "                at_ms = new.created_at_ms",
        "                at_ms = 0",
        "each created event of a combined batch carries its own create's time",
        "tests/concurrency/test_combined_creates.py::test_creates_for_distinct_users_share_batches_and_each_gets_its_own_order",
    ),
    mutation(
        "combined-create-not-confirmed",
        "orders/rules/combining.py",
        "            self.admitter.confirmations.committed(new.user_id, new.id)",
        "            pass",
        "a create committed in a batch is confirmed, so no later refusal asks SQL about it",
        "tests/concurrency/test_combined_creates.py::test_creates_for_distinct_users_share_batches_and_each_gets_its_own_order",
    ),
    mutation(
        "create-not-confirmed",
        "orders/rules/admission.py",
        "            self.confirmations.committed(new.user_id, new.id)",
        "            pass",
        "a create committed alone is confirmed, so a refusal a minute later asks no SQL",
        "tests/integration/test_confirmations.py::test_a_refusal_of_orders_a_minute_old_costs_one_round_trip_once_they_are_confirmed",
    ),
    mutation(
        "nested-call-waits-for-itself",
        "orders/rules/batching.py",
        "        return self._owner == threading.get_ident()",
        "        return False",
        "a call made from inside the call in flight, on its thread, never waits for itself",
        "tests/unit/test_batch_queue.py",
    ),
    mutation(
        "stuck-call-holds-up-the-queue",
        "orders/rules/batching.py",
        "            if self._stuck():\n                self._go_past(member)",
        "            if False:\n                self._go_past(member)",
        "a caller arriving while the call in flight is stuck goes alone instead of queueing",
        "tests/unit/test_batch_queue.py",
    ),
    mutation(
        "aio-call-held-on-the-loop",
        "orders/aio/calls.py",
        "                return await settled(loop.run_in_executor(self._executor, job))",
        "                return job()",
        "300 asyncio creates at once run in the service's threads: the loop is never held 20 ms",
        "tests/concurrency/test_aio_burst.py",
    ),
    # --- combined transitions: one transaction, each caller its own outcome -------------------
    mutation(
        "combined-transitions-decide-nothing",
        "orders/rules/transition.py",
        "            pending.outcome = outcome",
        "            pending.outcome = None",
        "a combined transition's caller gets the outcome of the shared transaction",
        "tests/concurrency/test_combined_transitions.py::test_payments_cancels_and_extensions_in_one_batch_each_get_their_own_result",
    ),
    mutation(
        "combined-transition-unknown-not-settled",
        "orders/rules/transition.py",
        "            if pending.unknown:",
        "            if False:",
        "followers of a cut-off leader make Redis follow their rows",
        "tests/concurrency/test_combined_transitions.py::test_a_batch_whose_commit_is_not_known_leaves_no_member_behind",
    ),
    mutation(
        "combined-transition-commit-not-read",
        "orders/sql/records.py",
        "        return not driver.in_transaction",
        "        return False",
        "a batch committed before its leader was cut off hands out its outcomes (none runs twice)",
        "tests/concurrency/test_combined_transitions.py::test_a_leader_cut_off_in_its_commit_leaves_each_transition_made_once",
    ),
    # --- issue 46: rules that no test guarded -------------------------------------------------
    mutation(
        "schema-conflict-misses-primary-keys",
        "orders/sql/migrate.py",
        '        names[str(schema_table.primary_key.name)] = "index"',
        "        pass",
        "SchemaConflict names a primary-key name of ours taken (PostgreSQL: its index's name)",
        "tests/integration/test_shared_database.py::test_a_primary_key_name_of_ours_taken_is_a_conflict_where_the_engine_shares_it",
    ),
    mutation(
        "combined-create-asks-again-after-no-answer",
        "orders/rules/combining.py",
        "        if member.entered > self.admitter.unanswered_at:",
        "        if True:",
        "a combined create queued behind a call Redis left unanswered does not ask again",
        "tests/crash/test_stalled_redis.py::test_combined_creates_in_a_stall_end_within_the_single_paths_bound",
    ),
    mutation(
        "combined-create-no-answer-not-recorded",
        "orders/rules/admission.py",
        "                self.unanswered_at = time.monotonic()",
        "                pass",
        "an admission Redis left unanswered is recorded for the creates queued behind it",
        "tests/crash/test_stalled_redis.py::test_combined_creates_in_a_stall_end_within_the_single_paths_bound",
    ),
    mutation(
        "combined-create-interrupted-leader-not-settled",
        "orders/rules/combining.py",
        "            batch[0].error, batch[0].unsettled = stop, True",
        "            batch[0].error, batch[0].unsettled = stop, False",
        "a combined-create leader interrupted in its insert leaves no row and no member of its own",
        "tests/concurrency/test_combined_creates.py::test_a_leader_interrupted_in_its_insert_leaves_nothing_of_its_own_and_followers_go_alone",
    ),
    mutation(
        "combined-transition-unknown-leader-not-settled",
        "orders/rules/transition.py",
        "            for pending in batch:",
        "            for pending in batch[1:]:",
        "a combined transition batch whose commit is not known settles its leader too",
        "tests/concurrency/test_combined_transitions.py::test_a_batch_whose_commit_is_not_known_leaves_no_member_behind",
    ),
)
