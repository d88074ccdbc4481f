from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ShopConfig(AppConfig):
    # Not "orders": a package of that name would hide the orders library from `import orders`.
    name = "shop"

    def ready(self) -> None:
        post_migrate.connect(upgrade_orders_schema, sender=self)


def upgrade_orders_schema(using: str, **_kwargs: Any) -> None:
    """After Django's migrate (also of the test database it makes), orders' own tables
    (``oes_*``, their revision in ``oes_alembic_version``) in the same database."""
    from orders.bootstrap import build_engine  # noqa: PLC0415  (the app registry loads first)
    from orders.config import Settings  # noqa: PLC0415
    from orders.sql import migrate  # noqa: PLC0415
    from shop.glue import database_url  # noqa: PLC0415

    url = database_url(using).render_as_string(hide_password=False)
    engine = build_engine(Settings(database_url=url))
    try:
        if not migrate.is_current(engine):
            migrate.upgrade(engine)
    finally:
        engine.dispose()
