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
        "                CLOSE_ALL_EXPIRED.run_all(conn, params, SLOT_REUSE, actor)",
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
