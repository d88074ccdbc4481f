"""The ``orders`` command: operate the service from a shell.

``app`` holds the group, its global options and the error mapping; the commands register
themselves on it from ``order_commands``, ``ops_commands``, ``store_commands``,
``event_commands``, ``payment_commands``, ``limit_commands``, ``resource_commands``,
``waiting_commands`` and ``upkeep_commands``; ``render`` prints. The benchmark command is
loaded only when it is run.
"""

from orders.cli import (
    event_commands,
    limit_commands,
    ops_commands,
    order_commands,
    payment_commands,
    resource_commands,
    store_commands,
    upkeep_commands,
    waiting_commands,
)
from orders.cli.app import EXIT_CODES, exit_code, main

__all__ = [
    "EXIT_CODES",
    "event_commands",
    "exit_code",
    "limit_commands",
    "main",
    "ops_commands",
    "order_commands",
    "payment_commands",
    "resource_commands",
    "store_commands",
    "upkeep_commands",
    "waiting_commands",
]
