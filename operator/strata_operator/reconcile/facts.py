"""The reads a reconcile decides from: the namespace, the PVC, the credentials Secret (Kubernetes
API) and whether the bucket answers (GCS).

Rule: the effect half of :mod:`strata_operator.reconcile.policy`; every read becomes a fact
(:class:`~strata_operator.reconcile.policy.Facts`), and only a failing Kubernetes API is an error
(:class:`~strata_operator.reconcile.policy.ApiUnavailable`). It decides nothing.

GCS reachability: checked with the operator's own credentials when it has any (Application
Default Credentials), with anonymous credentials against an emulator (an ``http://``
``tiers.gcs.endpoint``, else ``STORAGE_EMULATOR_HOST``: fake-gcs-server), and with the policy's
service-account key when ``credentials.type`` is SecretRef. Without credentials the check is skipped and the Degraded condition says so: under
workload identity the training pods' identity, not the operator's, holds the bucket permission.
"""

from __future__ import annotations

import json
import os
from typing import Any

from strata_operator import constants as k
from strata_operator.api import CheckpointPolicySpec, GcsTierSpec
from strata_operator.reconcile.policy import (
    ApiForbidden,
    ApiUnavailable,
    BucketFact,
    Facts,
    PvcFact,
    SecretFact,
)


def _read_json(call: Any, *args: Any, timeout: float) -> dict[str, Any] | None:
    """``call(*args)`` as JSON; None on 404; :class:`ApiUnavailable` on other API errors."""
    from kubernetes.client.exceptions import ApiException

    try:
        resp = call(*args, _preload_content=False, _request_timeout=timeout)
    except ApiException as exc:
        status = getattr(exc, "status", None)
        if status == 404:
            return None
        if status == 403:
            raise ApiForbidden(
                k.REASON_API_ERROR,
                f"the operator may not read {call.__name__} {args!r}: {exc.reason}; "
                "grant it get on persistentvolumeclaims, secrets and namespaces",
                retry_after=60.0,
            ) from None
        raise ApiUnavailable(f"Kubernetes API error {status}: {exc.reason}") from None
    except OSError as exc:
        raise ApiUnavailable(f"Kubernetes API unreachable: {exc}") from None
    data: dict[str, Any] = json.loads(resp.data)
    return data


def gather(
    core_v1: Any,
    spec: CheckpointPolicySpec,
    namespace: str,
    *,
    check_bucket: bool = True,
    gcs_timeout: float = 10.0,
    api_timeout: float = 10.0,
) -> Facts:
    """Read the facts :func:`evaluate` needs. ``core_v1`` is a ``kubernetes.client.CoreV1Api``.

    Errors: :class:`ApiUnavailable` when the Kubernetes API fails; GCS failures are facts
    (``BucketFact``), never exceptions.
    """
    ns = _read_json(core_v1.read_namespace, namespace, timeout=api_timeout) or {}
    labels = dict((ns.get("metadata") or {}).get("labels") or {})
    pvc_fact = None
    if spec.tiers.pvc is not None:
        pvc = _read_json(
            core_v1.read_namespaced_persistent_volume_claim,
            spec.tiers.pvc.claim_name,
            namespace,
            timeout=api_timeout,
        )
        if pvc is None:
            pvc_fact = PvcFact(found=False)
        else:
            pvc_fact = PvcFact(
                found=True,
                phase=(pvc.get("status") or {}).get("phase"),
                access_modes=tuple((pvc.get("spec") or {}).get("accessModes") or ()),
            )
    secret_fact = None
    bucket_fact = None
    gcs = spec.tiers.gcs
    if gcs is not None:
        ref = gcs.credentials.secret_ref
        if ref is not None:
            try:
                secret = _read_json(
                    core_v1.read_namespaced_secret, ref.name, namespace, timeout=api_timeout
                )
            except ApiForbidden:
                # The chart grants nothing cluster-wide on Secrets (least privilege): without a
                # namespaced Role the operator cannot look inside; the sidecar still can.
                bucket_fact = BucketFact(
                    "not-checked",
                    f"the operator may not read Secret {ref.name!r} in {namespace!r}; grant it "
                    "a namespaced Role with get on that Secret to check the bucket",
                )
                return Facts(namespace_labels=labels, pvc=pvc_fact, bucket=bucket_fact)
            data = (secret or {}).get("data") or {}
            secret_fact = SecretFact(
                found=secret is not None,
                has_key=ref.key in data,
                key_json=_b64(data.get(ref.key)),
            )
        if check_bucket:
            bucket_fact = check_bucket_reachable(gcs, secret_fact, timeout=gcs_timeout)
    return Facts(namespace_labels=labels, pvc=pvc_fact, secret=secret_fact, bucket=bucket_fact)


def _b64(value: str | None) -> str | None:
    if value is None:
        return None
    import base64

    try:
        return base64.b64decode(value).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


def check_bucket_reachable(
    gcs: GcsTierSpec, secret: SecretFact | None, *, timeout: float = 10.0
) -> BucketFact:
    """Ask GCS for the bucket's metadata (``storage.buckets.get``); never raises.

    Endpoint: the policy's ``tiers.gcs.endpoint``, else ``STORAGE_EMULATOR_HOST``, else the real
    service (the sidecar resolves it the same way). Credentials, in order: anonymous when the
    endpoint is an emulator (``http://``); the policy's service-account key (SecretRef); the
    operator's Application Default Credentials; none -> ``not-checked``.
    """
    try:
        from google.api_core import exceptions as gexc
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
    except ImportError:
        return BucketFact("not-checked", "google-cloud-storage is not installed in the operator")
    credentials: Any
    project: str | None = None
    endpoint = gcs.endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if endpoint and endpoint.startswith("http://"):
        credentials, project = AnonymousCredentials(), "strata-emulator"  # type: ignore[no-untyped-call]
    elif secret is not None and secret.key_json:
        try:
            from google.oauth2 import service_account

            info = json.loads(secret.key_json)
            credentials = service_account.Credentials.from_service_account_info(info)  # type: ignore[no-untyped-call]
            project = info.get("project_id")
        except (ValueError, KeyError) as exc:
            return BucketFact(
                "not-checked", f"the secretRef key is not a service-account key: {exc}"
            )
    else:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            credentials, project = google.auth.default()
        except DefaultCredentialsError:
            return BucketFact(
                "not-checked",
                "the operator has no Google credentials (workload identity grants the training "
                "pods, not the operator, access to the bucket)",
            )
    try:
        client = storage.Client(
            project=project,
            credentials=credentials,
            client_options={"api_endpoint": endpoint} if endpoint else None,
        )
        client.bucket(gcs.bucket).reload(timeout=timeout, retry=None)
    except gexc.NotFound as exc:
        return BucketFact("not-found", str(exc.message))
    except gexc.Forbidden as exc:
        return BucketFact("forbidden", f"the operator's credentials may not read it: {exc.message}")
    except gexc.GoogleAPICallError as exc:
        return BucketFact("unreachable", str(exc))
    except Exception as exc:  # transport errors (requests, urllib3, socket) vary by stack
        return BucketFact("unreachable", f"{type(exc).__name__}: {exc}")
    return BucketFact("ok")
