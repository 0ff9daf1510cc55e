"""A stand-in for the kubelet (which kwok fakes): run a pod's containers as local processes,
configured from the pod *as the apiserver stored it* (after the real webhook injected it).

What a kubelet would do, done locally and only as far as Strata needs it:

* volumes: ``emptyDir`` -> a per-pod directory (``medium: Memory`` on the machine's tmpfs,
  /dev/shm); ``persistentVolumeClaim`` -> one shared directory per claim (the RWX filesystem),
  plus the mount's ``subPath``; ``projected`` -> a directory holding the service-account token
  (a real TokenRequest bound to the pod, with the source's audience and expiration) and the
  downward-API files (``metadata.annotations['...']`` / ``metadata.labels['...']``);
* env: literal values and downward-API ``fieldRef``s resolved from the stored pod;
* the pod's own network namespace: each pod's ``STRATA_CONFIG`` gets its own metrics port on
  127.0.0.1 (pods on one machine would otherwise share 9464), and every path inside it that lies
  under a volume mount is mapped to that volume's local directory.

Nothing else of the pod spec is interpreted; the command run is given by the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.cluster import REPO_ROOT, loopback_env
from strata.testing.ports import free_port as free_port


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """Resolve a downward-API fieldPath (``metadata.name``, ``metadata.labels['k']``, ...)."""
    meta = pod.get("metadata") or {}
    for prefix, mapping in (
        ("metadata.labels['", meta.get("labels") or {}),
        ("metadata.annotations['", meta.get("annotations") or {}),
    ):
        if path.startswith(prefix) and path.endswith("']"):
            return str(mapping.get(path[len(prefix) : -2], ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName"),
    }
    if path not in simple:
        raise ValueError(f"fieldPath {path!r} is not supported by the local kubelet")
    return str(simple[path] or "")


@dataclass
class LocalPod:
    """One pod's local volumes and processes."""

    pod: dict[str, Any]
    root: Path
    volumes: dict[str, Path]
    metrics_port: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    def container(self, name: str) -> dict[str, Any]:
        spec = self.pod["spec"]
        for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
            if c["name"] == name:
                return dict(c)
        raise KeyError(f"pod {self.name} has no container {name!r}")

    def log_text(self, container: str) -> str:
        try:
            return self.logs[container].read_text(errors="replace")
        except (KeyError, OSError):
            return ""


class LocalKubelet:
    """Materialises pods' volumes and runs their containers as local processes."""

    def __init__(self, api_client: client.ApiClient, workdir: Path, shm_root: Path) -> None:
        self.api = api_client
        self.workdir = workdir
        self.shm_root = shm_root
        self.pvc_root = workdir / "pvcs"
        self.pods: list[LocalPod] = []

    # --- volumes --------------------------------------------------------------------------------

    def _token(self, pod: Mapping[str, Any], source: Mapping[str, Any]) -> str:
        meta = pod["metadata"]
        sa = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        resp = client.CoreV1Api(self.api).create_namespaced_service_account_token(
            sa,
            meta["namespace"],
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [source["audience"]] if source.get("audience") else [],
                    "expirationSeconds": int(source.get("expirationSeconds", 3600)),
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta["name"],
                        "uid": meta["uid"],
                    },
                },
            },
        )
        return str(resp.status.token)

    def _volume(self, pod: Mapping[str, Any], vol: Mapping[str, Any], root: Path) -> Path:
        name = vol["name"]
        if "emptyDir" in vol:
            base = self.shm_root if (vol["emptyDir"] or {}).get("medium") == "Memory" else root
            path = base / pod["metadata"]["uid"] / name
        elif "persistentVolumeClaim" in vol:
            path = self.pvc_root / vol["persistentVolumeClaim"]["claimName"]
        elif "projected" in vol:
            path = root / "projected" / name
            path.mkdir(parents=True, exist_ok=True)
            for source in vol["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    sat = source["serviceAccountToken"]
                    (path / sat["path"]).write_text(self._token(pod, sat))
                for item in (source.get("downwardAPI") or {}).get("items") or []:
                    value = field_value(pod, item["fieldRef"]["fieldPath"])
                    (path / item["path"]).write_text(value)
        else:
            path = root / "other" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def admit(self, pod: dict[str, Any]) -> LocalPod:
        """Prepare a stored pod (it must have a uid): volumes, token, downward API files."""
        root = self.workdir / "pods" / pod["metadata"]["uid"]
        root.mkdir(parents=True, exist_ok=True)
        volumes = {
            v["name"]: self._volume(pod, v, root) for v in (pod["spec"].get("volumes") or [])
        }
        local = LocalPod(pod=pod, root=root, volumes=volumes, metrics_port=free_port())
        self.pods.append(local)
        return local

    # --- containers ------------------------------------------------------------------------------

    def _map_path(self, local: LocalPod, container: Mapping[str, Any], path: str) -> str:
        best: tuple[int, str] | None = None
        for mount in container.get("volumeMounts") or []:
            mp = mount["mountPath"].rstrip("/")
            if path == mp or path.startswith(mp + "/"):
                base = local.volumes.get(mount["name"])
                if base is None:
                    continue
                if mount.get("subPath"):
                    base = base / mount["subPath"]
                    base.mkdir(parents=True, exist_ok=True)
                mapped = str(base) + path[len(mp) :]
                if best is None or len(mp) > best[0]:
                    best = (len(mp), mapped)
        return best[1] if best else path

    def env(self, local: LocalPod, container_name: str) -> dict[str, str]:
        """The container's environment as the kubelet would set it (paths/ports localised)."""
        container = local.container(container_name)
        env: dict[str, str] = {}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "fieldRef" in (e.get("valueFrom") or {}):
                env[e["name"]] = field_value(local.pod, e["valueFrom"]["fieldRef"]["fieldPath"])
        if "STRATA_CONFIG" in env:
            cfg = json.loads(env["STRATA_CONFIG"])

            def remap(section: dict[str, Any] | None, key: str) -> None:
                if section is not None and section.get(key):
                    section[key] = self._map_path(local, container, section[key])

            cfg.setdefault("ram", {}).setdefault("path", "/strata/ram")
            remap(cfg.get("ram"), "path")
            if cfg.get("pvc") is not None:
                cfg["pvc"].setdefault("path", "/strata/pvc")
                remap(cfg.get("pvc"), "path")
            report = cfg.setdefault("report", {})
            report.setdefault("token_path", "/var/run/secrets/strata.dev/token")
            remap(report, "token_path")
            remap(report, "ca_path")
            remap(cfg, "socket_path")
            cfg["metrics_port"] = local.metrics_port
            cfg["metrics_host"] = "127.0.0.1"
            env["STRATA_CONFIG"] = json.dumps(cfg)
        return env

    def run(
        self,
        local: LocalPod,
        container_name: str,
        argv: list[str],
        extra_env: Mapping[str, str] | None = None,
        tag: str | None = None,
    ) -> subprocess.Popen[bytes]:
        env = {
            k: v
            for k, v in loopback_env().items()
            if not k.startswith(("STRATA_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))
        }
        env.update(self.env(local, container_name))
        env.update(extra_env or {})
        env["PYTHONUNBUFFERED"] = "1"
        key = tag or container_name
        log_path = local.root / f"{key}.log"
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT
            )
        local.procs[key] = proc
        local.logs[key] = log_path
        return proc

    def run_sidecar(self, local: LocalPod, name: str, timeout: float = 60.0) -> None:
        """Start the injected sidecar (``strata sidecar``) and wait for its startupProbe path."""
        self.run(local, name, [sys.executable, "-m", "strata.cli", "sidecar"])
        probe = local.container(name).get("startupProbe", {}).get("httpGet", {})
        url = f"http://127.0.0.1:{local.metrics_port}{probe.get('path', '/healthz')}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = local.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"sidecar exited {proc.returncode}:\n{local.log_text(name)}")
            with contextlib.suppress(OSError), opener.open(url, timeout=1) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"sidecar of {local.name} not ready:\n{local.log_text(name)}")

    def terminate(self, local: LocalPod, key: str, timeout: float = 60.0) -> int | None:
        """SIGTERM (what the kubelet sends when the pod stops), then SIGKILL after ``timeout``."""
        proc = local.procs.get(key)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def close(self) -> None:
        for local in self.pods:
            for proc in local.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(10)
            shutil.rmtree(self.shm_root / local.pod["metadata"]["uid"], ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.shm_root)
