"""The embedded default stores: a redis-server of our own beside a SQLite file.

``binary`` (finding and starting redis-server), ``server`` (the embedded home and its
server's life), ``client`` (the client that restarts it when it went away) and ``locks``
(the file locks that let many processes on one host share one embedded server).

May import: the modules below the use cases (``errors``, ``config``, ``domain`` ...) and
``orders.index``; nothing of SQL's or above.
"""
