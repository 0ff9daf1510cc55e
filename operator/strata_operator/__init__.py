"""The Strata operator: the CheckpointPolicy API, pod injection, reconcile and report intake.

Layers, top to bottom; a layer imports only the layers below it (the import-linter ``layers``
contract in pyproject.toml holds them), and the roles of one layer never import each other:

* **Entry points** — :mod:`~strata_operator.main` (the command line and composition root: it
  lists the roles, builds what they share, registers their handlers into one kopf registry),
  :mod:`~strata_operator.kubectl` (the ``kubectl strata`` plugin), :mod:`~strata_operator.crdgen`
  (renders the CRD from the models). Nothing imports them.
* **Roles** — :mod:`~strata_operator.admission` (webhook: object in, JSON patch or refusal out),
  :mod:`~strata_operator.reconcile` (policy spec and dependencies -> conditions),
  :mod:`~strata_operator.reports` (sidecar reports -> ``status.jobs``, Events, metrics). Each is
  pure decisions plus one handler module, the only place where its domain errors become kopf
  errors; each joins the operator as an :class:`~strata_operator.extension.Extension` object.
* **Contract** — :mod:`~strata_operator.extension`: the ``Extension`` protocol and the
  ``Wiring`` that ``main`` hands every role (one ``configure(args, wiring)`` for all).
* **Effects** — :mod:`~strata_operator.cluster` (the one writer of a policy's status and of
  Events), :mod:`~strata_operator.metrics` (Prometheus), :mod:`~strata_operator.certs` (TLS).
* **Translation** — :mod:`~strata_operator.sidecar_config`: a parsed spec -> the sidecar
  contract :class:`strata.config.StrataConfig` (pure).
* **API** — :mod:`~strata_operator.api`: pydantic models of spec and status, value rules,
  ``metav1.Condition`` helpers (pure: no I/O, no Kubernetes client, no kopf).
* **Names** — :mod:`~strata_operator.constants`: every label, annotation, condition type and
  reason, Event reason and injected name. Plain constants.

The operator never imports torch; the data plane (``strata``) never imports the operator.
"""
