"""The Strata operator: the CheckpointPolicy API, pod injection, reconcile and report intake.

Layers, each with its rule (import-linter and the tests keep them apart):

* **Names** — :mod:`~strata_operator.constants`: every label, annotation, condition type and
  reason, Event reason and injected name. Plain constants; imports nothing of ours.
* **API** — :mod:`~strata_operator.api.validation` (value rules, Kubernetes-exact parsers) and
  :mod:`~strata_operator.api` (pydantic models of spec and status, classes ending in ``Spec``
  and ``Status``; the mapping to the sidecar contract :class:`strata.config.SidecarConfig`).
  Pure: no I/O, no Kubernetes client, no kopf. :mod:`~strata_operator.crdgen` renders the CRD
  from them.
* **Decisions** — :mod:`~strata_operator.admission.mutation`, :mod:`~strata_operator.admission.pod_checks`,
  :mod:`~strata_operator.admission.workloads` (admission: object in, JSON patch or refusal out),
  :mod:`~strata_operator.api.conditions`, :mod:`~strata_operator.reconcile.dependencies` and the pure half of
  :mod:`~strata_operator.reconcile` (``parse_spec``/``evaluate``/``new_status``). Pure: unit
  tested without a cluster; domain errors (``InjectionError``, ``ReconcileError``) only.
* **Effects** — ``reconcile.gather`` (reads the cluster and GCS), :mod:`~strata_operator.certs`,
  :mod:`~strata_operator.reports.coalescer` (asyncio batching), :mod:`~strata_operator.metrics`.
* **Handlers** — :mod:`~strata_operator.main` (kopf settings, the policy reconcile handler, the
  dependency watches, the command line), :mod:`~strata_operator.admission.webhook` (admission server and
  its configuration), :mod:`~strata_operator.reports.receiver` (sidecar reports). The only modules that
  register kopf handlers, and the only place where domain errors become
  ``kopf.PermanentError``/``TemporaryError``/``AdmissionError``.

The operator never imports torch; the data plane (``strata``) never imports the operator.
"""
