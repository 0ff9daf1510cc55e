"""Admission: what the webhook adds to a Pod or a workload, and the server that answers the
apiserver.

Rule: the decisions are pure functions of (object, policy) -> JSON patch or refusal
(:mod:`~strata_operator.admission.mutation` for Pods, :mod:`~strata_operator.admission.workloads`
for Jobs/JobSets/PyTorchJobs, :mod:`~strata_operator.admission.pod_checks` for the checks an
injected pod must pass, :mod:`~strata_operator.admission.peers` for peer TLS material);
:mod:`~strata_operator.admission.webhook` is the only module of the package that speaks to kopf
and the apiserver (with :mod:`~strata_operator.admission.policy_cache` and
:mod:`~strata_operator.admission.peer_admission`), and the only place where an
``InjectionError`` becomes a ``kopf.AdmissionError``. Admission never imports reconcile or
reports.
"""
