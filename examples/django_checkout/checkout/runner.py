"""Django's test runner, closing orders' services before it drops the test databases."""

from __future__ import annotations

from typing import Any

from django.test.runner import DiscoverRunner
from shop.glue import close_services


class CheckoutTestRunner(DiscoverRunner):
    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        # The services' pools hold connections to the test database: PostgreSQL refuses to
        # drop a database that is still in use.
        close_services()
        super().teardown_databases(old_config, **kwargs)
