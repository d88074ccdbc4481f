"""What the tests share, and nothing else: helpers, never fixtures or tests.

Fixtures live in the ``conftest.py`` files and are only ever requested, never imported; a
test module imports from here, never from another test module or a conftest
(``tests/unit/test_test_layout.py`` holds every test file to that). Here: the clocks,
throwaway servers (``redis_server``, ``postgres``, ``cluster``), readers and writers of the
stores (``stores``, ``plans``), child processes (``processes``: the one wrapper of a process
a test starts, and the helpers to run one), the one limit monitor (``monitor``), the
bookkeeping of the load workers (``tally``), the checks several crash and concurrency tests
make (``checks``), and the scripts run as subprocesses (``workers``).
"""
