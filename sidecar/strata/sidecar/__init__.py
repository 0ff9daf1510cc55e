"""The sidecar process (``strata sidecar``): promotion RAM -> PVC -> GCS, retention, the SIGTERM
flush, restore staging for the trainer, ``/metrics`` and ``/healthz``, reports to the operator.

Rule: never imports the training client nor torch (the sidecar image has no torch); talks to the
trainer only through :mod:`strata.protocol` on its unix socket, and to tiers only through the
:class:`strata.tiers.base.Tier` contract (plus the RAM tier's slots). Needs no Kubernetes API.
"""
