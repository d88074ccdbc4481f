"""The rules of the hold that span both stores, each a part the service composes.

``admission`` (Redis admit, SQL guard, compensation, the one Redis-outage policy) and
``abandoning`` (the undo of an admission of unknown outcome); ``transition`` (a
compare-and-set, then Redis); ``payments`` (who wins between a payment and an expiry, and
the loser's money); ``creating`` (a create's way, and at the limit the oldest order
replaced); ``extending`` (more time, within the order's policy); ``user_limits`` (a user's
own limit and its Redis copy); ``pausing`` (the incident pause and the resume that gives
the time back); ``retention`` (pruning old orders); ``erasure`` (a user erased, over the
bulk cancel).

They import the stores' layers (``orders.sql``, ``orders.index``) and the values below
them, and each other downwards only: a second import-linter contract in pyproject.toml
orders them, and docs/architecture.md says why. Nothing here is imported by ``sql`` or
``index``; ``orders.service`` and the scheduler compose them.
"""
