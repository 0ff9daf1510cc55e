"""Reports: sidecar reports -> ``status.jobs[]``, Events and metrics.

Rule: :mod:`~strata_operator.reports.fold` is the pure fold of a report into the status and its
Events; :mod:`~strata_operator.reports.coalescer` batches them per policy (asyncio, no API);
:mod:`~strata_operator.reports.receiver` is the HTTPS endpoint and the only module of the package
that speaks to kopf. Status and Events are written through :mod:`strata_operator.cluster`.
Reports never import admission or reconcile.
"""
