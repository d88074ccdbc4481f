"""The record: every order and every transition, in SQL (SQLAlchemy Core, Alembic).

``models`` (the order tables; ``SCHEMA``, every table), ``base`` (what the tables share)
and ``inventory_tables`` (resources, holds, units, waiting lists), ``failures``
(driver-error translation), ``engine`` (building engines), ``transactions`` (how a use case
opens its one transaction on each engine), ``host`` (the host's transaction a use case is
given as ``connection=``, and following its end), ``transitions`` (compare-and-set updates
with their event in the same statement), ``slots`` (the SQL limit guard), ``records`` (the
use cases' reads and writes), ``closing`` (the sweep's batch), ``erasure`` (a user id
replaced by its pseudonym), ``reconcile_reads``, ``stats`` and ``migrate``.

May import: ``domain``, ``config``, ``validation``, ``metrics``, ``logs``, ``errors``. Never the
Redis side (``orders.index``) nor anything above.
"""
