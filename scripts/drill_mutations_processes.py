"""The mutation drill's list, second half: the breaks of the processes' rules (the sweep,
reconcile, the lease, validation, event consumers, the scheduler's logs, stats, the embedded
server). The stores' half, and what a mutation is, are in drill_mutations.py; the combined
paths' in drill_mutations_combined.py; the breaks first caught by the tests written for
them, in drill_mutations_guarded.py.
"""

from __future__ import annotations

from drill_mutations import STORE_MUTATIONS, Mutation, mutation
from drill_mutations_combined import COMBINED_MUTATIONS
from drill_mutations_guarded import GUARDED_MUTATIONS
from drill_mutations_holds import HOLD_MUTATIONS
from drill_mutations_transitions import TRANSITION_MUTATIONS

PROCESS_MUTATIONS: tuple[Mutation, ...] = (
    # --- the sweep ---------------------------------------------------------------------------
    mutation(
        "sweep-skips-orders-due-exactly-now",
        "orders/sql/predicates.py",
        "orders_table.c.expires_at_ms <= cutoff_ms",
        "orders_table.c.expires_at_ms < cutoff_ms",
        "an order is due at its expiry instant",
        "tests/integration/test_sweep.py::test_sweep_closes_orders_due_at_or_before_now_and_keeps_later_ones",
    ),
    mutation(
        "sweep-closes-orders-not-yet-due",
        "orders/rules/sweep.py",
        "        cutoff = self.cutoff(now_ms)",
        "        cutoff = self.cutoff(now_ms) + 1",
        "the sweep never closes an order before its expiry",
        "tests/integration/test_sweep.py::test_sweep_closes_orders_due_at_or_before_now_and_keeps_later_ones",
    ),
    mutation(
        "sweep-cutoff-ahead-of-the-clock",
        "orders/validation.py",
        "    if now_ms > clock_now:",
        "    if False:",
        "a sweep cutoff ahead of the clock is refused",
        "tests/integration/test_sweep.py::test_sweep_with_a_cutoff_ahead_of_the_clock_raises_and_closes_nothing",
    ),
    mutation(
        "sweep-redis-cleanup-skipped",
        "orders/index/unpaid.py",
        'run_per_key(self.client, b"ZREMRANGEBYSCORE", keys, (b"-inf", b"%d" % now_ms))',
        "None",
        "the sweep drops the closed orders' expired members",
        "tests/integration/test_sweep.py::test_sweep_closes_ten_due_orders_in_four_batches_of_three",
    ),
    mutation(
        "sweep-skip-locked-removed",
        "orders/sql/closing.py",
        "due = due.with_for_update(skip_locked=True)",
        "due = due.with_for_update()",
        "PostgreSQL: a sweeper skips rows another holds, never waits on them",
        "tests/integration/test_sweep.py::test_sweep_skips_a_due_order_locked_by_another_transaction[redis7.0-postgresql-server]",
    ),
    # --- reconcile ---------------------------------------------------------------------------
    mutation(
        "reconcile-removes-in-flight-members",
        "orders/rules/reconcile.py",
        "remove = [(u, o) for u, o in extras if o in owners and owners[o] != u]",
        "remove = [(u, o) for u, o in extras if owners.get(o) != u]",
        "a member without a SQL row (a create in flight) stays until its expiry",
        "tests/integration/test_reconcile.py::test_a_member_without_a_sql_row_is_kept_until_its_own_expiry",
    ),
    mutation(
        "reconcile-leaves-a-stale-add",
        "orders/rules/reconcile.py",
        "            self._undo_stale_adds(added, now_ms)",
        "            pass",
        "an add racing a payment does not leave a stale member",
        "tests/integration/test_reconcile.py::test_an_add_that_races_a_payment_does_not_leave_a_stale_member",
    ),
    # --- the scheduler's lease ---------------------------------------------------------------
    mutation(
        "lease-released-by-another-owner",
        "orders/index/lua/lease_release.lua",
        "if redis.call('GET', key) == ARGV[1] then",
        "if true then",
        "only the lease's owner can release it",
        "tests/integration/test_sweeper.py::test_lease_is_taken_by_one_owner_renewed_and_released_only_by_it",
        "tests/integration/test_sweeper.py::test_close_releases_our_lease_and_never_another_owners",
    ),
    mutation(
        "lease-renewed-by-another-owner",
        "orders/index/lua/lease.lua",
        "if holder == owner then",
        "if true then",
        "only the lease's owner can renew it",
        "tests/integration/test_sweeper.py::test_lease_is_taken_by_one_owner_renewed_and_released_only_by_it",
    ),
    # --- input validation --------------------------------------------------------------------
    mutation(
        "ttl-maximum-unchecked",
        "orders/validation.py",
        "    if ttl_s > max_ttl_s:",
        "    if False:",
        "a TTL above the maximum (milliseconds by mistake) is refused",
        "tests/unit/test_domain.py::test_a_ttl_given_in_milliseconds_by_mistake_is_caught_by_the_maximum",
    ),
    mutation(
        "user-id-key-unsafe-characters-allowed",
        "orders/validation.py",
        "        if key_safe and ch in KEY_UNSAFE:",
        "        if False:",
        "user ids may not contain {}*?[] (hash tags, glob patterns)",
        "tests/unit/test_domain.py::test_bad_user_ids_are_refused_without_echoing_them",
    ),
    # --- event consumers ---------------------------------------------------------------------
    mutation(
        "consumer-cursor-not-saved",
        "orders/events/consumer.py",
        "                self.book.save_position(conn, event.position)",
        "                pass",
        "a consumer saves its position after each event",
        "tests/integration/test_event_retries.py::test_an_event_that_used_its_attempts_is_parked_logged_once_and_never_tried_again",
        "tests/integration/test_events.py::test_a_consumer_killed_mid_stream_resumes_without_losing_or_skipping_an_event",
    ),
    mutation(
        "parked-events-retried",
        "orders/events/retries.py",
        ".where(RC.consumer == self.name, RETRYING, RC.next_at_ms <= self.clock())",
        ".where(RC.consumer == self.name, RC.next_at_ms <= self.clock())",
        "a parked event is never retried until requeued",
        "tests/integration/test_event_retries.py::test_an_event_that_used_its_attempts_is_parked_logged_once_and_never_tried_again",
    ),
    mutation(
        "park-one-attempt-late",
        "orders/events/retries.py",
        "park = attempts >= self.max_attempts",
        "park = attempts > self.max_attempts",
        "an event is parked after max_attempts tries, not one more",
        "tests/integration/test_event_retries.py::test_max_attempts_one_parks_at_the_first_failure",
    ),
    mutation(
        "pg-reader-passes-a-running-transaction",
        "orders/events/stream.py",
        "        return EC.txid < func.txid_snapshot_xmin(func.txid_current_snapshot())",
        "        return true()",
        "PostgreSQL: readers never pass an event of a transaction still running",
        "tests/integration/test_events.py::test_postgresql_readers_never_pass_an_event_of_a_transaction_still_running[redis7.0-postgresql]",
    ),
    # --- the scheduler: its logs, its rebuild beside the sweep, its jobs' next runs ----------
    mutation(
        "sweep-line-after-lease-lost-silent",
        "orders/scheduler/sweeper.py",
        '                fields["lease_lost"] = True',
        "                pass",
        "a sweep line written after the lease was lost says so",
        "tests/crash/test_frozen_sweeper.py::test_a_sweeper_frozen_mid_batch_holds_no_order_and_a_standby_finishes_the_sweep",
    ),
    mutation(
        "summary-every-tick",
        "orders/scheduler/log.py",
        "(not force and now - self._since < self.period_s)",
        "(not force and False)",
        "the scheduler's summary comes at most once per period",
        "tests/integration/test_sweeper.py::test_summary_comes_at_most_once_per_period_with_the_totals_since_the_last_one",
    ),
    mutation(
        "backlog-clears-at-the-threshold",
        "orders/scheduler/log.py",
        "if self._since is not None and lag_ms <= self.lag_ms // 2:",
        "if self._since is not None and lag_ms <= self.lag_ms:",
        "a backlog clears only well under its threshold (no line every tick near it)",
        "tests/integration/test_sweeper.py::test_backlog_is_logged_at_once_when_it_starts_and_once_when_it_clears",
    ),
    mutation(
        "rebuild-does-not-yield-to-the-sweep",
        "orders/scheduler/rebuild.py",
        "            if self._not_ticking.wait(REBUILD_WAIT_S):",
        "            if True:",
        "the index rebuild waits for a running sweep",
        "tests/integration/test_sweeper.py::test_rebuild_waits_for_a_running_tick_before_it_starts_and_between_its_chunks",
    ),
    mutation(
        "sweep-waits-out-the-cadence",
        "orders/scheduler/jobs.py",
        "delay_s = sweeper.cadence_s if event.exception is not None else event.retval",
        "delay_s = sweeper.cadence_s",
        "a job runs again when its last run asked (the sweep at the next expiry)",
        "tests/integration/test_sweeper.py::test_background_scheduler_wakes_at_each_expiry_and_shuts_down_cleanly",
    ),
    mutation(
        "next-run-set-on-apschedulers-threads",
        "orders/scheduler/jobs.py",
        'threading.Thread(target=action, args=args, name="orders-reschedule").start()',
        "action(*args)",
        "a run's next run (and a blocking scheduler's stop) is set after APScheduler's own"
        " update of the job, on a thread of its own",
        "tests/concurrency/test_scheduler_never_skips.py::test_runs_that_end_before_apscheduler_has_finished_submitting_them_keep_their_job_going",
        "tests/concurrency/test_scheduler_never_skips.py::test_a_blocking_scheduler_stopped_by_a_run_that_ends_during_its_submission_returns_cleanly",
    ),
    # --- bounded stats, the self-healing embedded server ----------------------------------------
    mutation(
        "stats-window-start-inclusive",
        "orders/sql/stats.py",
        "return and_(column > self.since_ms, column <= self.until_ms)",
        "return and_(column >= self.since_ms, column <= self.until_ms)",
        "a stats window is open at its start and closed at its end",
        "tests/integration/test_stats.py::test_the_window_is_open_at_its_start_and_closed_at_its_end",
    ),
    mutation(
        "embedded-server-not-restarted",
        "orders/embedded/client.py",
        "            if self.restarter is not None and nothing_listens(error):",
        "            if False:",
        "a process that finds its embedded redis-server dead starts it again",
        "tests/integration/test_embedded.py::test_a_command_in_flight_when_the_server_dies_completes_on_a_restarted_one",
        "tests/integration/test_embedded.py::test_a_stopped_server_comes_back_but_not_in_a_removed_home",
    ),
    # --- the incident pause, erasure, the host's savepoints ---------------------------------
    mutation(
        "resume-shifts-orders-due-as-the-pause-began",
        "orders/sql/pauses.py",
        "ORDER.expires_at_ms > _STARTED,",
        "ORDER.expires_at_ms >= _STARTED,",
        "a resume shifts only the orders whose expiry came after the pause began",
        "tests/integration/test_pauses.py::test_a_resume_shifts_only_the_orders_whose_expiry_came_after_the_pause_began",
    ),
    mutation(
        "resume-rescores-only-present-members",
        "orders/rules/pausing.py",
        "                self.followups.rescore(wanted, now_ms)",
        "                self.followups.index.rescore_present(wanted)",
        "a resume gives every order it moved its member, even one dropped by an admission",
        "tests/integration/test_pauses.py::test_orders_due_during_a_pause_keep_their_members_through_the_resume",
    ),
    mutation(
        "resume-restores-members-of-orders-paid-meanwhile",
        "orders/rules/pausing.py",
        "                self.followups.index.remove_members(left)",
        "                pass",
        "an order paid between its resume batch and the restore does not get its member back",
        "tests/integration/test_pauses.py::test_an_order_paid_after_its_resume_batch_does_not_get_its_member_back",
    ),
    mutation(
        "pause-start-read-before-it-takes-hold",
        "orders/sql/pauses.py",
        "                .values(started_at_ms=clock())",
        "                .values(started_at_ms=PAUSE.started_at_ms)",
        "a pause's recorded start is when it takes hold: a close committed before is before it",
        "tests/integration/test_pauses.py::test_a_close_committed_before_the_pause_takes_hold_is_not_during_it",
    ),
    mutation(
        "erasure-skips-its-second-refund-check",
        "orders/sql/erasure.py",
        "    if owed:",
        "    if False:",
        "erasure checks again, inside its own transaction, that no refund is owed",
        "tests/integration/test_erasure.py::test_erasure_checks_again_in_its_own_transaction_that_no_refund_is_owed",
    ),
    mutation(
        "savepoint-rollback-keeps-its-steps",
        "orders/sql/host.py",
        "            self.steps = [step for step in self.steps if step.level < self.depth]",
        "            pass",
        "rolling back a savepoint of the host's transaction undoes, in Redis, only the steps"
        " written inside that savepoint",
        "tests/integration/test_host_transaction.py::test_rolling_back_a_savepoint_undoes_in_redis_only_the_steps_written_inside_it",
    ),
    # --- the SQLite file guard (issue 46) --------------------------------------------------
    mutation(
        "host-sqlite-engine-unguarded",
        "orders/sql/transactions.py",
        "        refuse_replaced_sqlite_file(engine)  # a host's own SQLite engine too (issue 46)",
        "        pass",
        "a host's own SQLite engine is guarded like the service's: creates after the file is"
        " deleted are refused, none acknowledged",
        "tests/crash/test_sqlite_file_replaced.py::test_a_hosts_own_engine_is_guarded_too",
    ),
    mutation(
        "fresh-process-recreates-a-deleted-sqlite-file",
        "orders/sql/engine.py",
        "                self._refuse_a_deleted_file()",
        "                pass",
        "a fresh process finds a SQLite file deleted under running processes missing, says so"
        " and creates nothing",
        "tests/crash/test_sqlite_file_replaced.py::test_a_fresh_process_finds_the_file_missing_and_creates_nothing",
    ),
    mutation(
        "sqlite-file-never-marked",
        "orders/sql/engine.py",
        "                self._mark_opened()",
        "                pass",
        "after rm orders.db*, a fresh process finds the marker of the database that was there,"
        " refuses and creates nothing; orders db upgrade --new starts an empty one",
        "tests/crash/test_sqlite_file_replaced.py::test_a_fresh_process_after_rm_of_the_file_and_its_wal_refuses_and_creates_nothing",
        "tests/crash/test_sqlite_file_replaced.py::test_orders_db_upgrade_new_starts_an_empty_embedded_database_only_when_asked",
    ),
    mutation(
        "embedded-server-named-redis-server",
        "orders/embedded/server.py",
        'Path(info.get("executable", "redis-server")).name',
        '"redis-server"',
        "the embedded server's restart, stop and status lines name the program that runs",
        "tests/integration/test_embedded.py::test_the_restart_the_stop_and_the_status_name_the_binary_that_runs",
    ),
    # --- a new consumer and retention (issue 46) -------------------------------------------
    mutation(
        "new-consumer-starts-at-the-oldest-event",
        "orders/events/consumer.py",
        "        return self.book.register(lambda: newest_position(self.engine))",
        "        return self.book.register(EventPosition)",
        "a new consumer starts from now: registered after 1000 events, it holds no old order",
        "tests/integration/test_retention.py::test_a_consumer_registered_after_1000_events_does_not_hold_the_prune_of_old_ones",
    ),
    mutation(
        "consumer-from-oldest-starts-from-now",
        "orders/events/consumer.py",
        '        if self.start == "oldest":',
        "        if False:",
        "a consumer registered from the oldest reads every kept event",
        "tests/integration/test_retention.py::test_a_consumer_registered_from_the_oldest_reads_every_kept_event_holding_them_meanwhile",
    ),
    mutation(
        "retention-waits-on-a-stopped-consumer",
        "orders/sql/retention.py",
        "    reading = CURSOR.updated_at_ms >= cutoff_ms",
        "    reading = CURSOR.updated_at_ms >= 0",
        "retention waits on a consumer behind only while it reads: one stopped for the retention"
        " period is passed",
        "tests/integration/test_retention.py::test_a_consumer_standing_still_for_the_retention_period_holds_nothing_past_it",
    ),
    mutation(
        "retention-tells-no-consumer-behind",
        "orders/rules/retention.py",
        "        held_by, passed_by = self.retention.behind(cutoff_ms)",
        "        held_by, passed_by = [], []",
        "a prune names, in its log and report, the consumers behind: held for or passed",
        "tests/integration/test_retention.py::test_a_consumer_registered_from_the_oldest_reads_every_kept_event_holding_them_meanwhile",
        "tests/integration/test_retention.py::test_a_consumer_standing_still_for_the_retention_period_holds_nothing_past_it",
    ),
)

#: Every mutation the drill runs, in order.
MUTATIONS = (
    STORE_MUTATIONS
    + TRANSITION_MUTATIONS
    + COMBINED_MUTATIONS
    + PROCESS_MUTATIONS
    + GUARDED_MUTATIONS
    + HOLD_MUTATIONS
)
