"""The mutation drill's list, third part: breaks that no test caught until the tests in
``tests/unit/test_guarded_rules.py`` and ``tests/integration/test_guarded_rules.py`` were
written for them, and two rules whose existing tests had no break in the drill yet (what a
mutation is: drill_mutations.py; the runner joins the parts in drill_mutations_processes.py).
Kept apart so that each list stays a readable length.
"""

from __future__ import annotations

from drill_mutations import Mutation, mutation

UNIT = "tests/unit/test_guarded_rules.py"
INTEGRATION = "tests/integration/test_guarded_rules.py"
UNKNOWN_ORDER = "tests/integration/test_unknown_order_payments.py"
LIMITS = "tests/integration/test_user_limits.py"
LATE_WINDOW_TEST = (
    "tests/integration/test_payments.py"
    "::test_the_windows_last_millisecond_is_in_it_in_python_and_in_sql_alike"
)

GUARDED_MUTATIONS: tuple[Mutation, ...] = (
    # --- input checks and secrets ------------------------------------------------------------
    mutation(
        "user-id-closing-brackets-allowed",
        "orders/validation.py",
        'KEY_UNSAFE = frozenset("{}*?[]")',
        'KEY_UNSAFE = frozenset("{*?[")',
        "user ids refuse each of {}*?[] on its own, closing brackets too",
        f"{UNIT}::test_a_user_id_with_a_key_unsafe_or_line_separating_character_is_refused",
    ),
    mutation(
        "user-id-line-separators-allowed",
        "orders/validation.py",
        '("Cc", "Cs", "Cn", "Zl", "Zp")',
        '("Cc", "Cs", "Cn")',
        "ids refuse the line and paragraph separators U+2028, U+2029",
        f"{UNIT}::test_a_user_id_with_a_key_unsafe_or_line_separating_character_is_refused",
    ),
    mutation(
        "metadata-limit-in-characters",
        "orders/validation.py",
        'if len(encoded.encode("utf-8", "surrogatepass")) > max_bytes:',
        "if len(encoded) > max_bytes:",
        "the metadata limit counts UTF-8 bytes, not characters",
        f"{UNIT}::test_the_metadata_limit_counts_utf8_bytes_not_characters",
    ),
    mutation(
        "password-in-the-path-shown",
        "orders/config/urls.py",
        'path = parts.path if _PLAIN.fullmatch(parts.path) else f"/{HIDDEN}"',
        "path = parts.path",
        "a password spilled into a URL's path is hidden",
        f"{UNIT}::test_a_password_spilled_into_a_urls_path_is_hidden",
    ),
    # --- the asyncio API ---------------------------------------------------------------------
    mutation(
        "aio-queue-unbounded",
        "orders/aio/calls.py",
        "if waiting >= self.queue:",
        "if False:",
        "orders.aio refuses a call past aio_queue waiting ones (Overloaded), writing nothing",
        "tests/integration/test_aio_threads.py::"
        "test_a_call_past_the_queue_is_refused_at_once_and_writes_nothing",
    ),
    # --- the pre-close check -----------------------------------------------------------------
    mutation(
        "pre-close-extension-uncapped",
        "orders/rules/sweep.py",
        "extra_ms = min(check_ttl_ms(answer, max_ttl_s), max_extension_ms)",
        "extra_ms = check_ttl_ms(answer, max_ttl_s)",
        "a pre-close extension is at most max_extension_s",
        f"{INTEGRATION}::test_a_pre_close_extension_is_cut_to_max_extension_s",
    ),
    mutation(
        "pre-close-past-the-max-lifetime",
        "orders/rules/sweep.py",
        "if expires_at_ms - order.created_at_ms > max_lifetime_ms:",
        "if False:",
        "a pre-close extension never moves an expiry past created_at + max_lifetime_s",
        f"{INTEGRATION}::test_a_pre_close_extension_never_passes_the_maximum_lifetime",
    ),
    mutation(
        "pre-close-reopens-a-paid-order",
        "orders/sql/transitions.py",
        "[UNPAID_PREDICATE, ORDER.extensions == 0],",
        "[ORDER.extensions == 0],",
        "the pre-close check reopens only an order still unpaid",
        f"{INTEGRATION}::test_a_pre_close_check_that_sees_the_order_paid_does_not_reopen_it",
    ),
    # --- admission, reconcile, the sweep -----------------------------------------------------
    mutation(
        "create-takes-the-highest-free-slot",
        "orders/sql/slots.py",
        ".order_by(candidates.c.n)",
        ".order_by(candidates.c.n.desc())",
        "a create takes its user's lowest free slot",
        f"{INTEGRATION}::test_a_create_takes_the_lowest_free_slot",
    ),
    mutation(
        "write-back-latest-first",
        "orders/rules/admission.py",
        "sorted(refused.holders.items(), key=lambda h: h[1])",
        "sorted(refused.holders.items(), key=lambda h: -h[1])",
        "after Redis lost data, SQL's holders go back soonest expiry first",
        f"{INTEGRATION}::test_the_write_back_after_redis_lost_data_puts_the_soonest_expiries_back_first",
    ),
    mutation(
        "stale-add-check-reads-one-order-per-user",
        "orders/rules/reconcile.py",
        "added = [(user, order_id) for user in found.written for order_id in wanted[user]]",
        "added = [(user, next(iter(wanted[user]))) for user in found.written]",
        "reconcile's stale-add check reads every order it added",
        f"{INTEGRATION}::test_reconcile_undoes_every_add_that_raced_a_payment_not_only_the_first",
    ),
    mutation(
        "sweep-update-without-status-check",
        "orders/sql/closing.py",
        ".where(_claim(due, postgresql=postgresql), UNPAID_PREDICATE)",
        ".where(_claim(due, postgresql=postgresql))",
        "the sweep's UPDATE re-checks status = 'unpaid' (compare-and-set)",
        f"{INTEGRATION}::test_the_sweeps_update_itself_closes_only_rows_still_unpaid",
    ),
    # --- event consumers ---------------------------------------------------------------------
    mutation(
        "parked-event-overwritten-by-a-twin",
        "orders/events/retries.py",
        "upsert(conn, retries_table, key, values, only_if=lambda new: RETRYING)",
        "upsert(conn, retries_table, key, values)",
        "a parked event's entry is kept when a twin consumer fails on it again",
        f"{INTEGRATION}::test_a_parked_event_is_not_overwritten_by_a_twins_failure",
    ),
    mutation(
        "consumer-cursor-moves-back",
        "orders/events/retries.py",
        'upsert(conn, cursors_table, {"name": self.name}, values, only_if=ahead)',
        'upsert(conn, cursors_table, {"name": self.name}, values)',
        "a consumer's saved position only moves forward (a twin behind cannot move it back)",
        f"{INTEGRATION}::test_a_consumer_that_fell_behind_its_twin_never_moves_the_cursor_back",
    ),
    # --- rules an existing test already pinned, with no break in the drill yet ---------------
    mutation(
        "retry-with-another-amount-accepted",
        "orders/domain.py",
        "if order.amount != self.amount or order.currency != self.currency:",
        "if False:",
        "the same order id with another amount or currency is an OrderConflict",
        "tests/integration/test_create.py::test_the_same_order_id_with_another_amount_or_currency_is_a_conflict",
    ),
    mutation(
        "sweep-claims-in-any-order",
        "orders/sql/closing.py",
        "        .order_by(ORDER.expires_at_ms)\n",
        "",
        "a sweep batch claims the due orders soonest expiry first",
        "tests/integration/test_sweep.py::test_sweep_closes_orders_in_expiry_order_one_batch_at_a_time",
    ),
    # --- issue 46's rules no test guarded -------------------------------------------------------
    mutation(
        "late-window-last-ms-refused-in-python",
        "orders/rules/payments.py",
        "now_ms <= order.expires_at_ms + window_ms):",
        "now_ms < order.expires_at_ms + window_ms):",
        "a late payment at exactly expires_at + the window is accepted (the service's check)",
        LATE_WINDOW_TEST,
    ),
    mutation(
        "late-window-last-ms-refused-in-sql",
        "orders/sql/transitions.py",
        'ORDER.expires_at_ms + bindparam("window_ms", type_=BigInteger) >= _NOW,',
        'ORDER.expires_at_ms + bindparam("window_ms", type_=BigInteger) > _NOW,',
        "a late payment at exactly expires_at + the window is accepted (the compare-and-set)",
        LATE_WINDOW_TEST,
    ),
    mutation(
        "tls-options-allowed-on-a-unix-socket",
        "orders/config/urls.py",
        'if given and scheme != "rediss":',
        'if given and scheme not in ("rediss", "unix"):',
        "TLS options (ssl_*) are refused on any URL but rediss://, unix:// included",
        "tests/unit/test_settings_errors.py::test_a_malformed_url_is_invalid_input_naming_the_field_not_the_password",
    ),
    mutation(
        "keyfile-without-certfile-allowed",
        "orders/config/urls.py",
        "if keyfile is not None and certfile is None:",
        "if False:",
        "ssl_keyfile without ssl_certfile is refused",
        "tests/unit/test_settings_errors.py::test_a_malformed_url_is_invalid_input_naming_the_field_not_the_password",
    ),
    # --- issue 46's records: refusals that outlive their order, the limits' history --------
    mutation(
        "unknown-order-refusal-not-recorded",
        "orders/rules/payments.py",
        "                record_unknown_order(conn, order_id, payment, now_ms)",
        "                pass",
        "a payment for an order SQL does not hold records its refund before OrderNotFound",
        f"{UNKNOWN_ORDER}::test_a_payment_for_an_order_never_seen_raises_not_found_and_records_its_refund_once",
        f"{UNKNOWN_ORDER}::test_a_payment_for_a_pruned_order_is_owed_and_outlives_every_prune",
    ),
    mutation(
        "unknown-order-refusal-retry-conflicts",
        "orders/sql/refusals.py",
        ".values(values).on_conflict_do_nothing())",
        ".values(values))",
        "the same payment for a missing order, retried or raced, is one refusal",
        f"{UNKNOWN_ORDER}::test_concurrent_retries_of_one_payment_for_a_missing_order_record_one_refusal",
    ),
    mutation(
        "malformed-order-id-paid-unchecked",
        "orders/service.py",
        "        oid = check_order_id(order_id, self.settings.max_order_id_length)\n"
        "        payment = checked_payment(",
        "        oid = order_id\n        payment = checked_payment(",
        "a malformed order id is InvalidInput before anything is written, no refusal",
        f"{UNKNOWN_ORDER}::test_a_malformed_order_id_is_invalid_input_and_records_no_refusal",
    ),
    mutation(
        "pruned-orders-handled-refusals-kept",
        "orders/sql/retention.py",
        "    if deleted:",
        "    if False:",
        "a prune deletes the handled refusals of the orders it deletes (no cascade any more)",
        "tests/integration/test_retention.py::test_an_order_still_needed_is_kept_until_it_is_not",
    ),
    mutation(
        "limit-set-not-in-history",
        "orders/sql/user_limits.py",
        "        conn.execute(upsert)\n        _append_history(",
        "        conn.execute(upsert)\n        0 and _append_history(",
        "every set of a user's limit is appended to its history",
        f"{LIMITS}::test_every_set_and_clear_is_kept_in_the_users_history_newest_first",
    ),
    mutation(
        "limit-history-in-its-own-transaction",
        "orders/sql/user_limits.py",
        "        conn.execute(upsert)\n        _append_history(",
        "        conn.execute(upsert)\n        conn.commit()\n        _append_history(",
        "a limit change and its history commit together or not at all",
        f"{LIMITS}::test_a_limit_change_whose_history_cannot_be_written_changes_nothing",
    ),
    mutation(
        "limit-clear-not-in-history",
        "orders/sql/user_limits.py",
        "        if removed:",
        "        if False:",
        "a clear that removed a limit is appended to its history",
        f"{LIMITS}::test_every_set_and_clear_is_kept_in_the_users_history_newest_first",
    ),
    mutation(
        "erasure-keeps-limit-history",
        "orders/sql/erasure.py",
        "    conn.execute(delete(user_limit_history_table).where(HISTORY.user_id == user_id))",
        "    pass",
        "erasure deletes the user's limit history",
        "tests/integration/test_erasure.py::test_erasure_leaves_no_trace_of_the_user_in_either_store_and_keeps_paid_orders",
        "tests/integration/test_erasure.py::test_a_user_whose_limit_was_set_and_cleared_loses_its_limit_history",
    ),
    mutation(
        "erasure-unaware-of-history-only-users",
        "orders/sql/erasure.py",
        "(ORDER.user_id, LIMIT.user_id, HISTORY.user_id)",
        "(ORDER.user_id, LIMIT.user_id)",
        "a user with only a limit history is erased, not UnknownUser",
        "tests/integration/test_erasure.py::test_a_user_whose_limit_was_set_and_cleared_loses_its_limit_history",
    ),
)
