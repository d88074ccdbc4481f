"""The ``erased`` event kind (``erase_user``).

``oes_order_events`` admits the kind ``erased``: the record of a user's erasure, under its
pseudonym. Only the events' check changes, replaced as in 0008 (SQLite rebuilds the events
table).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from collections.abc import Sequence

from alembic import op

from orders.sql.migration_steps import replace_events_kind_check

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EVENTS = "oes_order_events"
OLD_KINDS = (
    "kind IN ('created', 'paid', 'cancelled', 'closed', 'extended',"
    " 'payment_refused', 'requeued', 'discarded', 'expiring')"
)
NEW_KINDS = (
    "kind IN ('created', 'paid', 'cancelled', 'closed', 'extended',"
    " 'payment_refused', 'requeued', 'discarded', 'expiring', 'erased')"
)


def upgrade() -> None:
    replace_events_kind_check(NEW_KINDS)


def downgrade() -> None:
    """Drops the ``erased`` events (the pseudonyms stay in place: an erasure is not undone;
    erasing such a user again then finds nothing and says UnknownUser)."""
    op.execute(f"DELETE FROM {EVENTS} WHERE kind = 'erased'")  # noqa: S608
    replace_events_kind_check(OLD_KINDS)
