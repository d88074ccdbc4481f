"""Concurrency tests across real processes and threads, on both SQL engines and real Redis.

The worker processes live in :mod:`tests.support.workers`; the tests start them by PID
and stop them by PID, each test on its own stores.
"""
