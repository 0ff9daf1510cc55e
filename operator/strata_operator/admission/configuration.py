"""The ``MutatingWebhookConfiguration`` of the operator's webhooks and the server that publishes it.

The configuration (default name ``strata.dev``) is written by this module, not by kopf's
``settings.admission.managed``: kopf 1.45's ``build_webhooks`` has no namespaceSelector,
reinvocationPolicy, matchConditions or timeout setting, and it rewrites the whole ``webhooks`` list
whenever the cluster's resources change, so post-processing would be undone.
:class:`ManagedWebhookServer` (a ``kopf.WebhookServer``) writes the configuration with the current
CA bundle *before* it starts listening, and again whenever kopf reloads changed certificate files:
after a restart with a new certificate, no admission request can reach the new server with the old
caBundle (C-11). The configuration stays in place when the operator stops, so that ``failurePolicy``
decides what happens meanwhile (C-10): ``Fail`` refuses training pods with the apiserver's "failed
calling webhook inject-pods.strata.dev" message; ``Ignore`` lets them start uninjected, and the
operator reports them when it is back (:mod:`strata_operator.reports.receiver`). kube-system and the
operator's own namespace are never sent to the webhook (namespaceSelector), so the cluster and the
operator itself can always start.

Rule: :func:`build_webhook_configuration` is pure (options + CA bundle -> the object);
:func:`apply_webhook_configuration` and :class:`ManagedWebhookServer` are its only writers. The
admission decisions are :mod:`strata_operator.admission.webhook`'s.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import kopf

from strata_operator.constants import MANAGED_BY, POD_WEBHOOK, POLICY_LABEL

WORKLOAD_WEBHOOKS: dict[str, tuple[str, str, str]] = {
    "label-jobs": ("batch", "v1", "jobs"),
    "label-jobsets": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    "label-pytorchjobs": ("kubeflow.org", "v1", "pytorchjobs"),
}
ANNOTATED = "has(object.metadata.annotations) && 'strata.dev/policy' in object.metadata.annotations"

FailurePolicy = Literal["Fail", "Ignore"]


@dataclass(frozen=True)
class WebhookOptions:
    """Where the webhook listens, how the apiserver reaches it, and its admission settings."""

    listen_host: str = "0.0.0.0"
    port: int = 9443
    url_host: str = "127.0.0.1"
    """Host in the ``url`` clientConfig (local control plane); unused with ``service``."""
    service: str | None = None
    """``<namespace>/<name>[:port]`` of the operator's Service (in-cluster clientConfig)."""
    configuration_name: str = "strata.dev"
    failure_policy: FailurePolicy = "Fail"
    """Fail: training pods are refused while the webhook is unreachable (they would run
    unprotected); Ignore: they run uninjected and are reported (C-10)."""
    timeout_seconds: int = 5
    """Per-call apiserver timeout (1-30 s); short, so that a hung operator cannot stall pod
    creation for long."""
    excluded_namespaces: tuple[str, ...] = ("kube-system",)
    """Never sent to the webhook, in addition to the operator's own namespace."""
    operator_namespace: str = "strata-system"
    manage_configuration: bool = True
    """False: a Helm chart / cert-manager CA injector owns the MutatingWebhookConfiguration."""

    def namespaces_excluded(self) -> list[str]:
        return sorted({*self.excluded_namespaces, self.operator_namespace})


def build_webhook_configuration(
    opts: WebhookOptions, *, ca_bundle: bytes, base_url: str | None = None
) -> dict[str, Any]:
    """The ``MutatingWebhookConfiguration`` object (pure; admissionregistration.k8s.io/v1).

    ``ca_bundle``: PEM the apiserver trusts for the webhook's certificate. ``base_url``: the
    ``https://host:port`` of the server (when ``opts.service`` is not set).
    """
    encoded = base64.b64encode(ca_bundle).decode("ascii")

    def client_config(handler_id: str) -> dict[str, Any]:
        if opts.service:
            ns, _, rest = opts.service.partition("/")
            name, _, port = rest.partition(":")
            svc: dict[str, Any] = {"namespace": ns, "name": name, "path": f"/{handler_id}"}
            if port:
                svc["port"] = int(port)
            return {"service": svc, "caBundle": encoded}
        if not base_url:
            raise ValueError("either WebhookOptions.service or base_url is required")
        return {"url": f"{base_url.rstrip('/')}/{handler_id}", "caBundle": encoded}

    namespace_selector = {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": opts.namespaces_excluded(),
            }
        ]
    }
    common = {
        # The pod webhook of a spec.peers policy creates the job's peer Secret, never on a dry run.
        "sideEffects": "NoneOnDryRun",
        "admissionReviewVersions": ["v1"],
        "failurePolicy": opts.failure_policy,
        "matchPolicy": "Equivalent",
        "timeoutSeconds": opts.timeout_seconds,
        "reinvocationPolicy": "IfNeeded",
        "namespaceSelector": namespace_selector,
    }
    webhooks = [
        {
            "name": f"{POD_WEBHOOK}.{opts.configuration_name}",
            "clientConfig": client_config(POD_WEBHOOK),
            "rules": [
                {
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                    "operations": ["CREATE"],
                    "scope": "Namespaced",
                }
            ],
            "objectSelector": {"matchExpressions": [{"key": POLICY_LABEL, "operator": "Exists"}]},
            **copy.deepcopy(common),
        }
    ]
    for handler_id, (group, version, plural) in WORKLOAD_WEBHOOKS.items():
        webhooks.append(
            {
                "name": f"{handler_id}.{opts.configuration_name}",
                "clientConfig": client_config(handler_id),
                "rules": [
                    {
                        "apiGroups": [group],
                        "apiVersions": [version],
                        "resources": [plural],
                        "operations": ["CREATE"],
                        "scope": "Namespaced",
                    }
                ],
                "matchConditions": [{"name": "strata-policy-annotation", "expression": ANNOTATED}],
                **copy.deepcopy(common),
            }
        )
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": opts.configuration_name, "labels": dict(MANAGED_BY)},
        "webhooks": webhooks,
    }


def apply_webhook_configuration(admission_api: Any, body: dict[str, Any]) -> None:
    """Create the configuration, or replace it wholesale (we own every webhook in it)."""
    from kubernetes.client.exceptions import ApiException

    name = body["metadata"]["name"]
    for _ in range(5):
        try:
            admission_api.create_mutating_webhook_configuration(body, _request_timeout=10)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        try:
            current = admission_api.read_mutating_webhook_configuration(name, _request_timeout=10)
            replacement = copy.deepcopy(body)
            replacement["metadata"]["resourceVersion"] = current.metadata.resource_version
            admission_api.replace_mutating_webhook_configuration(
                name, replacement, _request_timeout=10
            )
            return
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
    raise RuntimeError(f"MutatingWebhookConfiguration {name}: kept conflicting; giving up")


ConfigWriter = Callable[[bytes, str | None], Coroutine[Any, Any, None]]
Fallback = Callable[[dict[str, Any], str | None], Coroutine[Any, Any, dict[str, Any]]]


class ManagedWebhookServer(kopf.WebhookServer):
    """A ``kopf.WebhookServer`` that writes the webhook configuration before it listens (C-11).

    ``write_config(ca_bundle_pem, base_url)`` is awaited before the first listen and after every
    reload of changed certificate files (kopf re-reads them every ``file_check_interval``).
    ``fallback(review, handler_id)`` answers reviews for resources kopf has not discovered.
    """

    def __init__(
        self,
        *,
        write_config: ConfigWriter | None,
        fallback: Fallback | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._write_config = write_config
        self._fallback = fallback

    def base_url(self) -> str:
        return f"https://{self.host}:{self.port}"

    async def _publish(self) -> None:
        if self._write_config is not None and self.cafile is not None:
            await self._write_config(Path(self.cafile).read_bytes(), self.base_url())

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def guarded(request: dict[str, Any], **kwargs: Any) -> Any:
            try:
                return await fn(request, **kwargs)
            except Exception as exc:
                # kopf answers 404 for a resource it has not discovered (yet): a CRD installed or
                # reinstalled after the operator started may stay unknown to it. Serve those
                # webhooks directly; the decision is the same function either way.
                if type(exc).__name__ != "UnknownResourceError" or self._fallback is None:
                    raise
                return await self._fallback(request, kwargs.get("webhook"))

        await self._publish()
        first = True
        async for client_config in super().__call__(guarded):  # type: ignore[arg-type]
            if not first:
                await self._publish()
            first = False
            yield client_config
