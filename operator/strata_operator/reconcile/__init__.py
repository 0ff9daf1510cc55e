"""Reconcile: a CheckpointPolicy's spec and its dependencies -> its conditions.

Rule: :mod:`~strata_operator.reconcile.policy` holds the pure decisions (``parse_spec``,
``evaluate``, ``new_status``) and the reads they need (``gather``);
:mod:`~strata_operator.reconcile.dependencies` indexes which policy names which PVC/Secret;
:mod:`~strata_operator.reconcile.handlers` is the only module of the package that speaks to kopf
and the only place where a ``ReconcileError`` becomes a kopf error. Status and Events are
written through :mod:`strata_operator.cluster`. Reconcile never imports admission or reports.
"""
