#!/usr/bin/env python
"""Django's command line for the checkout example: ``python manage.py test``, ``runserver``."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "checkout.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
