"""The mutation drill's list, fourth part: the breaks of the holds' rules (issue 43), each
with the test that must catch it (what a mutation is: drill_mutations.py; the runner joins
the parts in drill_mutations_processes.py)."""

from __future__ import annotations

from drill_mutations import Mutation, mutation

HOLDS = "tests/integration/test_holds.py"
INDEX = "tests/integration/test_hold_index.py"
RACE = "tests/concurrency/test_hold_races.py"
UNITS = "tests/integration/test_units.py"

HOLD_MUTATIONS: tuple[Mutation, ...] = (
    mutation(
        "hold-guard-off-by-one",
        "orders/sql/holds.py",
        "        if units > free:",
        "        if units > free + 1:",
        "SQL refuses a hold past what is free, whatever Redis lost",
        f"{INDEX}::test_after_redis_loses_a_resource_sql_refuses_the_oversell_and_the_index_is_rebuilt",
    ),
    mutation(
        "hold-resources-not-locked",
        "orders/sql/holds.py",
        '    lock = _LOCK_FOR_UPDATE if conn.dialect.name == "postgresql" else _LOCK_PLAIN',
        "    lock = _LOCK_PLAIN",
        "a create locks its cart's resource rows before it sums what is held (PostgreSQL)",
        RACE,
        "-k",
        "postgresql",
    ),
    mutation(
        "hold-per-user-cap-off-by-one",
        "orders/sql/holds.py",
        "            if units > left:",
        "            if units > left + 1:",
        "a user holds and buys at most per_user units of a resource, paid orders included",
        f"{HOLDS}::test_a_per_user_cap_counts_unpaid_and_paid_orders_of_the_user",
    ),
    mutation(
        "hold-not-released-by-cancel",
        "orders/sql/transitions.py",
        '            "close_reason": bindparam("reason", type_=String),\n'
        "        },\n    ),\n    RELEASE,\n",
        '            "close_reason": bindparam("reason", type_=String),\n'
        "        },\n    ),\n    None,\n",
        "a cancel releases its order's units in its own statement",
        f"{HOLDS}::test_payment_sells_the_units_and_a_cancel_releases_them_naming_them_in_its_event",
    ),
    mutation(
        "hold-not-sold-by-payment",
        "orders/sql/transitions.py",
        "PAY = CompareAndSet(EventKind.PAID, _update([UNPAID_PREDICATE], _PAID), SELL)",
        "PAY = CompareAndSet(EventKind.PAID, _update([UNPAID_PREDICATE], _PAID))",
        "a payment turns its order's held units into sold ones",
        f"{HOLDS}::test_payment_sells_the_units_and_a_cancel_releases_them_naming_them_in_its_event",
    ),
    mutation(
        "hold-not-released-by-the-sweep-postgresql",
        "orders/sql/closing.py",
        "        holds=RELEASE,",
        "        holds=None,",
        "the sweep's batch releases the units of the orders it closes, in its one statement",
        f"{HOLDS}::test_the_sweep_releases_the_units_of_the_orders_it_closes_in_the_same_batch",
    ),
    mutation(
        "hold-not-released-by-the-sweep-sqlite",
        "orders/sql/closing.py",
        "                    sqlite_hold_changes(conn, holding, RELEASE)",
        "                    pass",
        "the sweep's batch releases the units of the orders it closes, in its transaction",
        f"{HOLDS}::test_the_sweep_releases_the_units_of_the_orders_it_closes_in_the_same_batch",
    ),
    mutation(
        "hold-late-payment-takes-units-unchecked",
        "orders/rules/payments.py",
        "                check_retake(conn, closed.user_id, order_id)",
        "                pass",
        "a late payment takes its released units again only while they are free",
        f"{HOLDS}::test_a_late_payment_takes_its_units_again_only_while_they_are_free",
    ),
    mutation(
        "hold-erasure-keeps-the-user-id",
        "orders/sql/erasure.py",
        "        .values(user_id=pseudonym)\n    )\n    limit_removed",
        "        .values(user_id=user_id)\n    )\n    limit_removed",
        "an erasure moves the user's holds to the pseudonym",
        f"{HOLDS}::test_erasure_and_replace_the_oldest_release_what_the_cancelled_orders_held",
    ),
    mutation(
        "hold-redis-refusal-ignored",
        "orders/rules/holding.py",
        "        if reserved.refused is not None:",
        "        if False:",
        "a sold-out cart is refused by Redis, with no SQL",
        f"{INDEX}::test_a_sold_out_cart_is_refused_by_redis_without_any_sql",
    ),
    mutation(
        "hold-unknown-resource-not-rebuilt",
        "orders/rules/admission.py",
        "            holding.rebuild_quietly(unknown, new.created_at_ms)",
        "            pass",
        "a resource Redis did not know is rebuilt from SQL once the create is over",
        f"{INDEX}::test_a_sold_out_cart_is_refused_by_redis_without_any_sql",
    ),
    mutation(
        "hold-reservation-kept-after-a-refusal",
        "orders/rules/admission.py",
        "            holding.release(new)  # if it committed after all (cut off): "
        "too few taken, safe",
        "            pass",
        "a create that does not commit gives its reserved units back in Redis",
        f"{INDEX}::test_a_create_refused_at_the_user_limit_gives_its_reserved_units_back",
    ),
    mutation(
        "hold-rebuild-without-second-read",
        "orders/rules/holding.py",
        "            for order_id in gone:",
        "            for order_id in ():",
        "a rebuild releases the members of holds released while it ran",
        f"{INDEX}::test_a_rebuild_releases_the_members_of_holds_released_while_it_ran",
    ),
    mutation(
        "hold-counter-not-released",
        "orders/sql/holds.py",
        '    if source == HOLD_HELD:\n        values["held"] = RESOURCE.held - units',
        "    if source == HOLD_HELD:\n        pass",
        "a release or a sale takes its units off the resource's held count",
        f"{HOLDS}::test_payment_sells_the_units_and_a_cancel_releases_them_naming_them_in_its_event",
    ),
    mutation(
        "hold-counter-not-taken",
        "orders/sql/holds.py",
        '    conn.execute(_ADD_HELD, [{"rid": rid, "units": units} for rid, units in new.holds])',
        "    pass",
        "a hold adds its units to the resource's held count in its own transaction",
        f"{INDEX}::test_after_redis_loses_a_resource_sql_refuses_the_oversell_and_the_index_is_rebuilt",
    ),
    mutation(
        "hold-reconcile-skips-resources",
        "orders/rules/reconcile.py",
        "            if self.holding is not None:",
        "            if False:",
        "reconcile rebuilds the resources that drifted",
        f"{INDEX}::test_reconcile_rebuilds_missing_and_stale_resources_and_removes_unknown_ones",
    ),
    mutation(
        "hold-reserve-ignores-expiry",
        "orders/index/lua/reserve.lua",
        "      local free = cap - (tonumber(state[2]) or 0) - (tonumber(state[3]) or 0) + gone",
        "      local free = cap - (tonumber(state[2]) or 0) - (tonumber(state[3]) or 0)",
        "a member whose order's expiry has passed frees its units at the next reserve",
        "tests/integration/test_resource_index.py",
        "-k",
        "expired_members_free",
    ),
    mutation(
        "unit-taken-not-refused",
        "orders/sql/units.py",
        "            if busy:\n                raise HoldRefused",
        "            if False:\n                raise HoldRefused",
        "a named unit held or sold is refused to a second order, naming it",
        f"{UNITS}::test_units_asked_by_name_are_held_by_one_order_and_a_second_ask_is_refused_naming_them",
    ),
    mutation(
        "unit-pick-not-lowest",
        "orders/sql/units.py",
        "    .order_by(UNIT.position)\n    .limit(",
        "    .order_by(UNIT.name.desc())\n    .limit(",
        "a count of a named resource picks the lowest free units in the resource's order",
        f"{UNITS}::test_a_count_of_a_named_resource_picks_the_lowest_free_units_in_its_order",
    ),
    mutation(
        "units-kept-at-release-postgresql",
        "orders/sql/holds.py",
        "add_cte(counted).add_cte(units)",
        "add_cte(counted)",
        "a transition moves its units with its hold in its one statement (PostgreSQL)",
        f"{UNITS}::test_payment_sells_the_units_and_cancel_and_the_sweep_free_them_naming_them",
    ),
    mutation(
        "units-kept-at-release-sqlite",
        "orders/sql/holds.py",
        "    move_units(conn, order_ids, change)\n",
        "    pass\n",
        "a transition moves its units with its hold in its transaction (SQLite)",
        f"{UNITS}::test_payment_sells_the_units_and_cancel_and_the_sweep_free_them_naming_them",
    ),
    mutation(
        "unit-in-use-removed",
        "orders/sql/units.py",
        "    if busy:\n        shown",
        "    if False:\n        shown",
        "a unit held or sold is never removed from its resource",
        f"{UNITS}::test_units_can_be_added_reordered_and_removed_but_never_one_held_or_sold",
    ),
    mutation(
        "late-payment-retakes-a-unit-taken",
        "orders/sql/holds.py",
        "        if rid in named and units_free_again(conn, order_id, rid) < units:",
        "        if False:",
        "a late payment takes its named units again only while nobody else took them",
        f"{UNITS}::test_a_late_payment_takes_its_units_again_only_while_nobody_else_took_them",
    ),
    mutation(
        "named-capacity-overwritten",
        "orders/sql/resources.py",
        "if current is not None and current.named and current.capacity != capacity:",
        "if False:",
        "a named resource's capacity is its number of units",
        f"{UNITS}::test_units_can_be_added_reordered_and_removed_but_never_one_held_or_sold",
    ),
)
