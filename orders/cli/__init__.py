"""The ``orders`` command: operate the service from a shell.

``app`` holds the group, its global options and the error mapping; the commands register
themselves on it from ``order_commands``, ``ops_commands`` and ``store_commands``;
``render`` prints. The benchmark command is loaded only when it is run.
"""

import orders.cli.event_commands  # noqa: F401 - registers `orders events` on main
from orders.cli import ops_commands, order_commands, store_commands
from orders.cli.app import EXIT_CODES, exit_code, main

__all__ = ["EXIT_CODES", "exit_code", "main", "ops_commands", "order_commands", "store_commands"]
