"""The service's configuration: :class:`Settings`, its single values and its URLs.

- :mod:`orders.config.settings`: :class:`Settings`, one frozen value read from ``ORDERS_*``
  environment variables or built in code;
- :mod:`orders.config.checks`: how its fields fit together (the checks across fields);
- :mod:`orders.config.values`: one setting's text read as its type, and the values with a
  syntax of their own (a create rate, event kinds, handler paths);
- :mod:`orders.config.urls`: store and webhook URLs and secrets, checked before anything
  connects and never shown with their secrets.

Nothing here connects or does I/O; it imports only the bottom layer (errors, validation,
policies, domain). ``from orders.config import Settings`` is the public way in.
"""

from orders.config.settings import Settings
from orders.config.urls import Secret, SecretUrl

__all__ = ["Secret", "SecretUrl", "Settings"]
