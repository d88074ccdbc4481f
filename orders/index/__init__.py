"""The Redis side: the admission index and what else lives in Redis.

``unpaid`` (the per-user sorted sets and their typed script wrappers; ``lua/`` holds the
scripts), ``resources`` (the counted resources' holds and sales, an index in front of SQL),
``limits`` (the copy of users' own limits), ``reconcile_batch`` (a batch of reconcile
scripts, sent at once and read later), ``epoch`` (the marker that tells a lost or
rewound index), ``errors`` (redis-py's exceptions as ``StoreUnavailable``), ``nodes`` (one
Redis or a cluster, key names), ``server_config`` (server settings that would lose data),
``pipeline`` (packs many script calls into few round trips), ``lease`` (the one active
sweeper) and ``heartbeat`` (every scheduler's beat).

May import: ``domain``, ``config``, ``validation``, ``metrics``, ``logs``, ``errors``. Never SQL
(``orders.sql``): Redis is the index, SQL the record, and only the use cases join them.
"""
