"""Settings of the checkout example.

The database is Django's ``default``: a SQLite file (``CHECKOUT_SQLITE_PATH``, by default
``db.sqlite3`` beside this project), or the PostgreSQL
database named by ``CHECKOUT_DATABASE_URL`` (``postgresql://user:password@host:port/name``;
``?host=/socket/folder`` for a unix socket). orders reaches the same database (see
``shop/glue.py``); its Redis and its limit come from the ``ORDERS_*`` variables.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import django

BASE_DIR = Path(__file__).resolve().parent.parent

# An example: a real deployment reads its own secret; this one signs nothing that matters.
SECRET_KEY = os.environ.get("CHECKOUT_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("CHECKOUT_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = ["django.contrib.contenttypes", "shop"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "checkout.urls"
TEST_RUNNER = "checkout.runner.CheckoutTestRunner"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def database(url: str | None) -> dict[str, Any]:
    """Django's ``default`` database from ``CHECKOUT_DATABASE_URL``, else a SQLite file.

    The SQLite test database is a file too (Django's default is in memory): orders' own
    engine must reach the same database, which a memory one cannot be.
    """
    if not url:
        path = Path(os.environ.get("CHECKOUT_SQLITE_PATH", BASE_DIR / "db.sqlite3"))
        sqlite: dict[str, Any] = {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path,
            "TEST": {"NAME": str(path.with_name(f"test_{path.name}"))},
        }
        if django.VERSION >= (5, 1):
            # The write lock at BEGIN, as orders' own transactions take it: a deferred
            # transaction that reads, then writes, fails at once if another wrote between.
            sqlite["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}
        return sqlite
    parts = urlsplit(url)
    if parts.scheme.split("+")[0] not in ("postgres", "postgresql"):
        raise ValueError("CHECKOUT_DATABASE_URL: a postgresql:// URL")
    query = parse_qs(parts.query)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or query.get("host", [""])[0],
        "PORT": str(parts.port or ""),
    }


DATABASES = {"default": database(os.environ.get("CHECKOUT_DATABASE_URL"))}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"orders": {"handlers": ["console"], "level": "WARNING"}},
}
