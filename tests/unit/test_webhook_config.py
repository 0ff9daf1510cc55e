"""The MutatingWebhookConfiguration the operator writes, the direct review path, and TLS files."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from cryptography import x509

from strata_operator import certs
from strata_operator.admission.configuration import (
    WORKLOAD_WEBHOOKS,
    WebhookOptions,
    build_webhook_configuration,
)
from strata_operator.admission.mutation import InjectionSettings
from strata_operator.admission.webhook import WebhookState, review_directly
from tests.fixtures.pods import jobset_obj, policy_obj

pytestmark = pytest.mark.unit


def test_configuration_has_selectors_timeouts_and_failure_policy() -> None:
    opts = WebhookOptions(failure_policy="Ignore", operator_namespace="strata", timeout_seconds=3)
    cfg = build_webhook_configuration(opts, ca_bundle=b"PEM", base_url="https://127.0.0.1:9443")
    hooks = {h["name"]: h for h in cfg["webhooks"]}
    assert set(hooks) == {"inject-pods.strata.dev", *(f"{h}.strata.dev" for h in WORKLOAD_WEBHOOKS)}
    for hook in hooks.values():
        assert hook["sideEffects"] == "NoneOnDryRun"  # the peer Secret is never made on a dry run
        assert hook["failurePolicy"] == "Ignore"
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["timeoutSeconds"] == 3
        assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == [
            "kube-system",
            "strata",
        ]
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == b"PEM"
    pods = hooks["inject-pods.strata.dev"]
    assert pods["clientConfig"]["url"] == "https://127.0.0.1:9443/inject-pods"
    assert pods["objectSelector"]["matchExpressions"] == [
        {"key": "strata.dev/policy", "operator": "Exists"}
    ]
    assert "matchConditions" in hooks["label-jobsets.strata.dev"]


def test_service_client_config() -> None:
    cfg = build_webhook_configuration(
        WebhookOptions(service="strata-system/strata:443"), ca_bundle=b"x"
    )
    assert cfg["webhooks"][0]["clientConfig"]["service"] == {
        "namespace": "strata-system",
        "name": "strata",
        "port": 443,
        "path": "/inject-pods",
    }


class _FakePolicies:
    """Stands in for the Kubernetes client's CustomObjectsApi (a dict of stored policies)."""

    def __init__(self, policies: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.policies = policies

    def get_namespaced_custom_object(
        self, g: str, v: str, ns: str, p: str, name: str, **_: Any
    ) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        if (ns, name) not in self.policies:
            raise ApiException(status=404, reason="Not Found")
        return self.policies[(ns, name)]


def _state(tmp_path: Path) -> WebhookState:
    return WebhookState(
        options=WebhookOptions(),
        injection=InjectionSettings(),
        tls=certs.generate(tmp_path),
        custom_api=_FakePolicies({("team-a", "fast"): policy_obj()}),
    )


def _review(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u1", "operation": "CREATE", "object": obj},
    }


def test_direct_review_labels_a_jobset_and_denies_a_missing_policy(tmp_path: Path) -> None:
    state = _state(tmp_path)
    js = jobset_obj("llm", policy="fast")
    js["metadata"]["namespace"] = "team-a"
    answer = asyncio.run(review_directly(state, _review(js), "label-jobsets"))
    response = answer["response"]
    assert response["uid"] == "u1" and response["allowed"] is True
    patched = jsonpatch.apply_patch(js, json.loads(base64.b64decode(response["patch"])))
    labels = patched["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"][
        "labels"
    ]
    assert labels["strata.dev/policy"] == "fast"
    js["metadata"]["annotations"]["strata.dev/policy"] = "absent"
    denied = asyncio.run(review_directly(state, _review(js), "label-jobsets"))["response"]
    assert denied["allowed"] is False and denied["status"]["code"] == 403
    assert "'absent' not found in namespace 'team-a'" in denied["status"]["message"]


def test_generated_certificate_serves_the_requested_names(tmp_path: Path) -> None:
    files = certs.generate(
        tmp_path, dns_names=("strata.strata-system.svc",), ip_addresses=("127.0.0.1",)
    )
    cert = x509.load_pem_x509_certificate(files.certfile.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "strata.strata-system.svc" in sans.get_values_for_type(x509.DNSName)
    ctx = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(files.certfile), str(files.keyfile))  # the pair matches
    assert (files.keyfile.stat().st_mode & 0o777) == 0o600
    first_ca = files.ca_pem
    # Every start makes a new CA (the webhook configuration is rewritten with it: C-11).
    assert certs.generate(tmp_path).ca_pem != first_ca


def test_mounted_secret_dir(tmp_path: Path) -> None:
    gen = certs.generate(tmp_path / "gen")
    mounted = tmp_path / "secret"
    mounted.mkdir()
    (mounted / "tls.crt").write_bytes(gen.certfile.read_bytes())
    (mounted / "tls.key").write_bytes(gen.keyfile.read_bytes())
    files = certs.load_or_generate(tmp_path / "work", tls_dir=mounted)
    assert not files.generated and files.cafile == mounted / "tls.crt"
    (mounted / "ca.crt").write_bytes(gen.cafile.read_bytes())
    assert certs.load_mounted(mounted).ca_pem == gen.ca_pem
    (mounted / "tls.key").unlink()
    with pytest.raises(certs.CertError, match=r"tls\.key is missing"):
        certs.load_mounted(mounted)
