"""Scripts the tests run as child processes (``python -m tests.support.workers.NAME``).

``sync``, ``aio``, ``hosts`` and ``pg`` speak the protocol of
:class:`tests.support.processes.ChildProcess` (``READY``, ``GO``, one JSON line of counts;
their side of it is ``protocol``); ``crash`` stops for good in the middle of a create,
``host_crash`` at the end of a host's transaction, ``hold_crash`` between the SQL commit
and the Redis writes of a create, payment or sweep with holds; ``refused_payment``
(``READY`` and ``GO`` too) kills itself around a refused payment; ``metrics`` runs
Prometheus in multiprocess mode, apart from pytest.
"""
