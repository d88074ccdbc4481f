"""``python -m orders``: the same as the ``orders`` command."""

from orders.cli import main

main()
