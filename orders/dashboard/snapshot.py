"""What the dashboard shows, read from both stores by bounded queries.

Every SQL statement here is served by an index (the figures ``orders stats`` prints, the
latest closes from the closed orders' partial index, one user's unpaid rows from the
per-user partial index, the consumers' lag from the events' commit-order index, the refunds
owed from the pending refusals' partial index, the resources running out and the longest
waiting lists from bounded ranges of their indexes: :mod:`orders.dashboard.stock`), so a
page costs the same with a thousand orders as with ten million. The Redis side is O(1)
per server (INFO memory, DBSIZE, the scheduler hash, the lease) or one user's key.

Each part of the overview is read on its own: a store that is down blanks the parts it
holds, with the error's one-line reason, and the others still show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, select

from orders.dashboard.stock import read_resources, read_waiting
from orders.domain import OrderStatus
from orders.errors import StoreUnavailable
from orders.events.admin import list_consumers
from orders.index.errors import redis_errors
from orders.index.heartbeat import Heartbeats
from orders.index.lease import SweeperLease
from orders.index.nodes import primaries
from orders.service import OrderService
from orders.sql.failures import sql_errors
from orders.sql.models import orders_table
from orders.sql.predicates import UNPAID_PREDICATE
from orders.sql.refusals import PaymentRefusal, refunds_owed
from orders.sql.stats import read_stats, status_is
from orders.validation import amount_to_text, check_user_id

OC = orders_table.c
T = TypeVar("T")

#: How far the overview looks: transitions in the last hour, expiries in the next ten minutes.
WINDOW_S = 3600
HORIZON_S = 600
BUCKETS = 20
RECENT_CLOSES = 10
#: A consumer's lag is counted up to here: the count costs the lag (an index range), and a
#: consumer far behind would make every refresh read its whole backlog.
LAG_CAP = 10_000
#: The refunds owed are counted up to here, for the same reason, and the latest are listed.
OWED_CAP = 10_000
OWED_LISTED = 10


def recent_closes(conn: Connection, limit: int = RECENT_CLOSES) -> list[dict[str, Any]]:
    """The latest orders the sweep closed, newest first, with their close lag.

    Read backwards along the closed orders' partial index on (closed_at_ms, expires_at_ms).
    """
    query = (
        select(OC.id, OC.user_id, OC.expires_at_ms, OC.closed_at_ms)
        .where(status_is(OrderStatus.CLOSED))
        .order_by(OC.closed_at_ms.desc())
        .limit(limit)
    )
    with sql_errors():
        rows = conn.execute(query).all()
    return [
        {
            "order_id": row.id,
            "user_id": row.user_id,
            "expires_at_ms": row.expires_at_ms,
            "closed_at_ms": row.closed_at_ms,
            "lag_ms": row.closed_at_ms - row.expires_at_ms,
        }
        for row in rows
    ]


def _part(read: Callable[[], T]) -> T | dict[str, str]:
    """``read()``, or ``{"error": reason}`` when its store is unavailable."""
    try:
        return read()
    except StoreUnavailable as exc:
        return {"error": str(exc)}


def _sql_figures(service: OrderService, now_ms: int) -> dict[str, Any]:
    with sql_errors(), service.engine.connect() as conn:
        stats = read_stats(conn, now_ms, window_s=WINDOW_S, horizon_s=HORIZON_S, buckets=BUCKETS)
        closes = recent_closes(conn)
    return {"stats": stats.as_dict(), "recent_closes": closes}


def _schedulers(service: OrderService, now_ms: int) -> dict[str, Any]:
    client = service.index.client
    prefix = service.index.key_prefix
    lease = SweeperLease(client, key_prefix=prefix)
    beats = Heartbeats(client, key_prefix=prefix).read(now_ms)
    with redis_errors("lease_ttl"):
        ttl_ms = int(client.pttl(lease.key))
    return {
        "lease_owner": lease.owner(),
        "lease_ttl_ms": ttl_ms if ttl_ms >= 0 else None,
        "schedulers": [asdict(beat) for beat in beats],
    }


def _consumers(service: OrderService) -> list[dict[str, Any]]:
    return [
        {
            "name": status.name,
            "cursor": f"{status.position.txid}/{status.position.event_id}",
            "lag_events": status.lag_events,
            "lag_capped": status.lag_capped,
            "oldest_unread_age_ms": status.oldest_unread_age_ms,
            "retrying": status.retrying,
            "parked": status.parked,
        }
        for status in list_consumers(service.engine, clock=service.clock, lag_cap=LAG_CAP)
    ]


def _owed_row(refusal: PaymentRefusal, now_ms: int) -> dict[str, Any]:
    return {
        "order_id": refusal.order_id,
        "user_id": refusal.user_id,
        "payment_ref": refusal.payment_ref,
        "reason": refusal.reason.value,
        # As text: the exact decimal the payment stated, which a JSON number could round.
        "amount": amount_to_text(refusal.amount),
        "currency": refusal.currency,
        "refused_at_ms": refusal.refused_at_ms,
        "age_ms": now_ms - refusal.refused_at_ms,
    }


def _refunds(service: OrderService, now_ms: int) -> dict[str, Any]:
    owed = refunds_owed(service.engine, cap=OWED_CAP, newest=OWED_LISTED)
    oldest_ms = owed.oldest_refused_at_ms
    return {
        "owed": owed.count,
        "owed_capped": owed.capped,
        "oldest_refused_at_ms": oldest_ms,
        "oldest_age_ms": None if oldest_ms is None else now_ms - oldest_ms,
        "newest": [_owed_row(refusal, now_ms) for refusal in owed.newest],
    }


def _redis(service: OrderService) -> dict[str, Any]:
    memory = keys = 0
    servers = primaries(service.index.client)
    with redis_errors("dashboard_info"):
        for server in servers:
            memory += int(server.info("memory")["used_memory"])
            keys += int(server.dbsize())
    return {"servers": len(servers), "used_memory_bytes": memory, "keys": keys}


def read_overview(service: OrderService) -> dict[str, Any]:
    """Everything the dashboard's live part shows, at the service's clock, as JSON data."""
    now_ms = service.clock()
    return {
        "at_ms": now_ms,
        "sql": _part(lambda: _sql_figures(service, now_ms)),
        "scheduling": _part(lambda: _schedulers(service, now_ms)),
        "consumers": _part(lambda: _consumers(service)),
        "refunds": _part(lambda: _refunds(service, now_ms)),
        "resources": _part(lambda: read_resources(service)),
        "waiting": _part(lambda: read_waiting(service, now_ms)),
        "redis": _part(lambda: _redis(service)),
        "pause": _part(lambda: _pause(service)),
    }


def _pause(service: OrderService) -> dict[str, Any] | None:
    """The open incident pause, if any: the sweep closes nothing while it lasts."""
    pause = service.operations.current_pause()
    if pause is None:
        return None
    return {
        "reason": pause.reason,
        "started_at_ms": pause.started_at_ms,
        "actor": None if pause.actor is None else str(pause.actor),
        "resuming": pause.resumed_at_ms is not None,
    }


@dataclass(frozen=True, slots=True)
class SlotRow:
    """One order of a user's, as each store holds it; None where a store lacks it."""

    order_id: str
    slot: int | None
    sql_status: str | None
    sql_expires_at_ms: int | None
    index_expires_at_ms: int | None
    time_left_ms: int
    #: See :data:`STATES`.
    state: str


#: What each state of a row means, and who changes it.
STATES = {
    "same": "both stores agree",
    "missing_in_index": "open in SQL, no member: reconcile adds it",
    "index_expiry_differs": "open in SQL, another score: reconcile rescores it",
    "expired_in_sql": "due in SQL: the sweep closes it and drops the member",
    "terminal_in_sql": "paid, cancelled or closed in SQL: reconcile removes the member",
    "expired_in_index": "no open row, score passed: the next admit or reconcile drops it",
    "no_row": (
        "no SQL row: kept while its create may be in flight; reconcile removes it once the"
        " create is certainly over (the admission window passed), else it drops at its expiry"
    ),
}


def _state(sql_status: str | None, sql_ms: int | None, index_ms: int | None, now_ms: int) -> str:
    if sql_status == OrderStatus.UNPAID.value and sql_ms is not None:
        if sql_ms <= now_ms:
            return "expired_in_sql"
        if index_ms is None:
            return "missing_in_index"
        return "same" if index_ms == sql_ms else "index_expiry_differs"
    if sql_status is not None:
        return "terminal_in_sql"
    if index_ms is not None and index_ms <= now_ms:
        return "expired_in_index"
    return "no_row"


def compare_user(service: OrderService, user_id: str) -> dict[str, Any]:
    """One user's unpaid orders from SQL and from the Redis index, side by side.

    The SQL side is every unpaid row of the user (an overdue one too, until the sweep
    closes it) and the status of every other order the index names; the index side is
    every member of the user's set. A row whose state is not ``same`` is what reconcile
    or the sweep would change (:data:`STATES`). Both reads are bounded by the user's
    orders: the unpaid rows come from the per-user partial index, the others by key.
    """
    uid = check_user_id(user_id, service.settings.max_user_id_length)
    now_ms = service.clock()
    members = service.index.members(uid)
    unpaid = (
        select(OC.id, OC.status, OC.slot, OC.expires_at_ms)
        .where(OC.user_id == uid, UNPAID_PREDICATE)
        .order_by(OC.expires_at_ms, OC.id)
    )
    with sql_errors(), service.engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(unpaid)}
        others = sorted(members.keys() - rows.keys())
        if others:
            named = select(OC.id, OC.status, OC.slot, OC.expires_at_ms).where(OC.id.in_(others))
            rows.update({row.id: row for row in conn.execute(named)})
    found = []
    for order_id in rows.keys() | members.keys():
        row = rows.get(order_id)
        sql_ms = None if row is None else int(row.expires_at_ms)
        sql_status = None if row is None else str(row.status)
        index_ms = members.get(order_id)
        expiry = sql_ms if sql_ms is not None else members[order_id]
        found.append(
            SlotRow(
                order_id=order_id,
                slot=None if row is None else row.slot,
                sql_status=sql_status,
                sql_expires_at_ms=sql_ms,
                index_expires_at_ms=index_ms,
                time_left_ms=max(0, expiry - now_ms),
                state=_state(sql_status, sql_ms, index_ms, now_ms),
            )
        )
    found.sort(key=lambda row: (row.time_left_ms, row.order_id))
    return {
        "at_ms": now_ms,
        "user_id": uid,
        "limit": service.settings.unpaid_limit,
        "rows": [asdict(row) for row in found],
        "differences": sum(row.state != "same" for row in found),
        "states": STATES,
    }
