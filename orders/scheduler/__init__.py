"""The ``orders scheduler`` process: what runs the sweep, reconcile and events on a clock.

``sweeper`` (one sweep under the lease), ``status`` (what a sweeper reports and beats),
``log`` (its log lines), ``jobs`` (the APScheduler jobs), ``health`` (the /healthz and
/readyz probes) and ``process`` (starting and stopping it all).

May import: the service and everything below it; not ``orders.dashboard`` (a sibling), the
CLI or the bench.
"""
