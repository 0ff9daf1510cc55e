"""The plugin's view of the cluster: a Kubernetes client from a kubeconfig (and context), the
context's namespace, and the reads every subcommand needs (policies, pods)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes import client, config

from strata_operator import api


@dataclass
class Cluster:
    api_client: Any
    default_namespace: str

    @classmethod
    def connect(cls, kubeconfig: str | None, context: str | None) -> Cluster:
        """A client for ``context`` of ``kubeconfig`` (defaults as kubectl: $KUBECONFIG,
        ~/.kube/config, the current context); in a pod without a kubeconfig, the in-cluster
        service account."""
        from strata_operator.kubectl import EXIT_USAGE, PluginError

        try:
            contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        except config.ConfigException as exc:
            if kubeconfig is None and context is None:
                try:
                    config.load_incluster_config()  # type: ignore[no-untyped-call]
                except config.ConfigException:
                    raise PluginError(f"no kubeconfig: {exc}", EXIT_USAGE) from None
                return cls(client.ApiClient(), _incluster_namespace())
            raise PluginError(f"kubeconfig: {exc}", EXIT_USAGE) from None
        chosen = current
        if context is not None:
            chosen = next((c for c in contexts if c["name"] == context), None)
            if chosen is None:
                names = ", ".join(c["name"] for c in contexts)
                raise PluginError(f"no context {context!r} in the kubeconfig ({names})", EXIT_USAGE)
        namespace = (chosen or {}).get("context", {}).get("namespace") or "default"
        api_client = config.new_client_from_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
        return cls(api_client, namespace)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.api_client.close()

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api_client)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    def policies(self, namespace: str | None) -> list[dict[str, Any]]:
        """CheckpointPolicy objects of ``namespace`` (None: every namespace), sorted."""
        resp: Any
        if namespace is None:
            resp = self.custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.PLURAL)
        else:
            resp = self.custom.list_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL
            )
        items: list[dict[str, Any]] = resp.get("items", [])
        return sorted(items, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"]))

    def pods(self, namespace: str | None, label_selector: str = "") -> list[dict[str, Any]]:
        """Pods as plain dicts (the API's camelCase JSON), optionally by label selector."""
        resp: Any
        if namespace is None:
            resp = self.core.list_pod_for_all_namespaces(
                label_selector=label_selector, _preload_content=False
            )
        else:
            resp = self.core.list_namespaced_pod(
                namespace, label_selector=label_selector, _preload_content=False
            )
        import json

        items: list[dict[str, Any]] = json.loads(resp.data).get("items", [])
        return items


def _incluster_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"
