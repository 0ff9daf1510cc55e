"""The peer tier between two real nodes: a pod whose RAM was lost restores from its peer's copy
over mutual TLS.

Real parts: the control plane (scheduler, Job controller), two kubelets v1.35.4 each with its own
containerd/runc and CNI bridge, routed to each other by the host (`e2e.node.pair`), the pair's
DNS serving the pods' host names (the peer tier finds peers by them), Strata's sidecar and trainer
images, the operator as a local process (its webhook injects the peer list and mounts the job's
peer Secret, which it creates), the kernel's tmpfs for the RAM tiers, torch.distributed gloo
between the two pods across the nodes, TLS 1.3 between the sidecars. Flow:

* an Indexed Job of two pods (one gloo rank each, one per node: podAntiAffinity) under a policy
  with the RAM tier and ``peers: {mode: replicate, copies: 1}`` and no PVC tier: the trainers
  save, and each sidecar pulls the other's newest RAM step into its RAM (seen on node B's tmpfs);
* the pod of rank 0 is deleted: its RAM emptyDir is gone with it. Its replacement (same host name,
  new pod IP) restores rank 0 from the peer tier, i.e. from the copy on node B, over mutual TLS:
  the restored step is the newest copy node B held, the tier is ``peer`` and the weights' digest
  equals what rank 0 saved at that step; rank 1 restores the same step from its own RAM, and both
  train on;
* node B's peer port refuses a client whose certificate is not of the job's CA (even with the
  job's URI SAN) or without one, and serves the job's own certificate (so the refusal is the CA
  check);
* the pair's DNS (`e2e.node.dns.PodDns`) against the real apiserver, without the nodes: pod host
  names resolve to the pod's IP, nothing else resolves.
"""

from __future__ import annotations

import base64
import datetime
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from e2e.cluster import LocalCluster
from e2e.node.fixtures import node_pair, strata_images  # noqa: F401 - fixtures
from e2e.node.harness import TOLERATION, RealNode
from e2e.node.operator import NodeOperator
from e2e.node.pair import NodePair
from e2e.node.story import (
    SIDECAR_IMAGE,
    container_status,
    kubectl_json,
    pod_events,
    saved_events,
    trainer_pod,
    wait_for,
)
from e2e.operator_fixtures import (
    OPERATOR_NAMESPACE,
    WEBHOOK_CONFIG,
    apply_crds,
    ensure_namespace,
)
from strata_operator.admission.peers import PEER_PORT, job_uri, peer_secret_name
from strata_operator.constants import POLICY_LABEL

pytestmark = [pytest.mark.e2e, pytest.mark.real_node, pytest.mark.timeout(1500)]

JOB = "llm"
POLICY = "peers"
RAM_EVERY = 2
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def report(request: pytest.FixtureRequest, line: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[node pair] {line}")
    print(line)


@pytest.fixture(scope="module")
def pair_operator(
    k8s_cluster: LocalCluster,
    node_pair: NodePair,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NodeOperator]:
    """The operator, its report receiver on node A's gateway (node B's pods reach it through
    the pair's routes)."""
    apply_crds(k8s_cluster)
    ensure_namespace(k8s_cluster, OPERATOR_NAMESPACE)
    op = NodeOperator(
        k8s_cluster, tmp_path_factory.mktemp("pair-operator"), node_pair.nodes[0].gateway
    )
    op.start()
    try:
        yield op
    finally:
        op.stop()
        k8s_cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found"
        )


def peers_policy(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "strata.dev/v1alpha1",
        "kind": "CheckpointPolicy",
        "metadata": {"name": POLICY, "namespace": ns},
        "spec": {
            # No PVC tier: a pod that lost its RAM can only restore from its peer (or start fresh).
            "tiers": {
                "ram": {
                    "medium": "Memory",
                    "sizeLimit": "64Mi",
                    "keep": 2,
                    "every": {"steps": RAM_EVERY},
                }
            },
            "peers": {"mode": "replicate", "copies": 1},
            "restore": {"allowFreshStart": True},
            "sidecar": {"image": SIDECAR_IMAGE, "terminationGracePeriodSeconds": 30},
        },
    }


def indexed_job(ns: str, nodes: list[str]) -> dict[str, Any]:
    """Two pods, one gloo rank each (rank = completion index), one per node of the pair."""
    pod = trainer_pod("unused", "unused", 100_000)
    spec = pod["spec"]
    del spec["nodeSelector"]
    spec["tolerations"] = [TOLERATION]
    spec["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                        ]
                    }
                ]
            }
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {JOB_NAME_LABEL: JOB}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        },
    }
    trainer = spec["containers"][0]
    master = f"{JOB}-0.strata-peers-{JOB}.{ns}.svc"
    trainer["env"] += [
        {"name": "WORLD_SIZE", "value": "2"},
        {
            "name": "RANK",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}},
        },
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": "29500"},
        {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
    ]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": JOB, "namespace": ns},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            # Container restarts of the surviving rank (its collective fails when its peer dies)
            # count against the limit under restartPolicy OnFailure.
            "backoffLimit": 50,
            # A replacement only once the old pod is gone: its IP and host name are free again.
            "podReplacementPolicy": "Failed",
            "template": {"metadata": {"labels": {POLICY_LABEL: POLICY}}, "spec": spec},
        },
    }


def job_pods(cluster: LocalCluster, ns: str) -> dict[int, dict[str, Any]]:
    """The live pods of the job by completion index."""
    items = kubectl_json(cluster, "-n", ns, "get", "pods", "-l", f"{JOB_NAME_LABEL}={JOB}")
    out: dict[int, dict[str, Any]] = {}
    for p in items["items"]:
        if p["metadata"].get("deletionTimestamp"):
            continue
        if (p.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            continue
        out[int(p["metadata"]["annotations"][INDEX_ANNOTATION])] = p
    return out


def running(pod: dict[str, Any]) -> bool:
    return bool(container_status(pod, "trainer").get("state", {}).get("running"))


def ram_dir(node: RealNode, pod: dict[str, Any]) -> Path:
    """The pod's strata-ram emptyDir (a tmpfs) on its node."""
    uid = str(pod["metadata"]["uid"])
    return (
        node.directory
        / "kubelet"
        / "pods"
        / uid
        / "volumes"
        / "kubernetes.io~empty-dir"
        / "strata-ram"
    )


def held_copies(node: RealNode, pod: dict[str, Any], owner: str) -> set[int]:
    """Steps of which ``pod`` holds a committed replica of ``owner``'s rank shards (the
    manifest is committed last)."""
    root = ram_dir(node, pod)
    return {int(m.parent.name) for m in root.glob(f"*/peers/{owner}/steps/*/rank-*.manifest")}


def restored(cluster: LocalCluster, ns: str, pod: str) -> dict[str, Any] | None:
    return next((e for e in pod_events(cluster, ns, pod) if e["event"] == "restored"), None)


# ----------------------------------------------------------------------------- TLS clients


def write_other_ca_client(directory: Path, job_id: str) -> tuple[Path, Path, Path]:
    """A CA that is not the job's and a client certificate it signed naming the job's URI SAN
    (what a pod outside the job could make); returns (ca, cert, key) paths."""
    now = datetime.datetime.now(datetime.UTC)

    def builder(subject: str, issuer: str, key: ec.EllipticCurvePrivateKey) -> Any:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder("not the job's CA", "not the job's CA", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        builder("intruder", "not the job's CA", key)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(job_uri(job_id))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = (directory / "other-ca.crt", directory / "other.crt", directory / "other.key")
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def inventory_request(
    ip: str, port: int, ca: Path, cert: Path | None, key: Path | None, verify_server: bool = True
) -> str:
    """``GET /v1/inventory`` over TLS 1.3 with the given client certificate (None: none); the
    raw answer (status line first). Raises ssl.SSLError / OSError when the peer refuses."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    if verify_server:
        ctx.load_verify_locations(cafile=str(ca))
    else:
        ctx.verify_mode = ssl.CERT_NONE
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    with (
        socket.create_connection((ip, port), timeout=10) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        tls.sendall(
            f"GET /v1/inventory HTTP/1.1\r\nHost: {ip}\r\nConnection: close\r\n\r\n".encode()
        )
        chunks = []
        while True:
            data = tls.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


# ----------------------------------------------------------------------------- the test


def test_pod_that_lost_its_ram_restores_from_its_peer_over_mtls(
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    node_pair: NodePair,  # noqa: F811
    pair_operator: NodeOperator,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    cluster, ns = k8s_cluster, k8s_namespace
    try:
        flow(cluster, ns, node_pair, tmp_path, request)
    finally:
        # Before the pair stops: the Job controller would otherwise re-create deleted pods.
        cluster.kubectl(
            "-n", ns, "delete", "job", JOB, "--cascade=foreground", "--ignore-not-found",
            "--wait=true", "--timeout=120s", check=False,
        )  # fmt: skip


def flow(
    cluster: LocalCluster,
    ns: str,
    node_pair: NodePair,  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    begin = time.monotonic()
    nodes = {n.name: n for n in node_pair.nodes}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(peers_policy(ns)))
    cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(indexed_job(ns, list(nodes))))

    pods = wait_for(
        "both pods of the job running",
        lambda: len(p := job_pods(cluster, ns)) == 2 and all(map(running, p.values())) and p,
        timeout=300,
    )
    on = {i: p["spec"]["nodeName"] for i, p in pods.items()}
    assert set(on.values()) == set(nodes), on  # one pod on each node
    node_b = nodes[on[1]]
    pod_a, pod_b = pods[0]["metadata"]["name"], pods[1]["metadata"]["name"]
    assert pods[0]["spec"]["hostname"] == f"{JOB}-0"
    # The pods reach each other across the nodes: gloo trains (both ranks save).
    wait_for(
        "three saves on both ranks",
        lambda: all(len(saved_events(cluster, ns, p)) >= 3 for p in (pod_a, pod_b)),
        timeout=300,
    )
    # Node B's sidecar pulls rank 0's RAM steps over mTLS into node B's RAM.
    wait_for(
        "a copy of rank 0's step on node B",
        lambda: held_copies(node_b, pods[1], f"{JOB}-0"),
        timeout=180,
    )
    trained_s = time.monotonic() - begin
    # The peers (and gloo's master address) were found by their pod host names.
    assert node_pair.dns is not None
    for index in (0, 1):
        host = f"{JOB}-{index}.strata-peers-{JOB}.{ns}.svc"
        assert any(q.startswith(host) for q in node_pair.dns.queries), (
            host,
            node_pair.dns.queries,
        )

    # Node B's peer port: the job's certificate is served, another CA's is refused.
    job_id = f"{ns}.{JOB}"
    secret = kubectl_json(cluster, "-n", ns, "get", "secret", peer_secret_name(job_id))
    job_files = {}
    for k in ("ca.crt", "tls.crt", "tls.key"):
        job_files[k] = tmp_path / f"job-{k}"
        job_files[k].write_bytes(base64.b64decode(secret["data"][k]))
    ip_b = pods[1]["status"]["podIP"]
    answer = inventory_request(
        ip_b, PEER_PORT, job_files["ca.crt"], job_files["tls.crt"], job_files["tls.key"]
    )
    assert answer.startswith("HTTP/1.") and " 200 " in answer.splitlines()[0], answer[:300]
    other_ca, other_cert, other_key = write_other_ca_client(tmp_path, job_id)
    for what, cert, key in (
        ("another CA's certificate naming the job", other_cert, other_key),
        ("no client certificate", None, None),
    ):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            got = inventory_request(ip_b, PEER_PORT, other_ca, cert, key, verify_server=False)
            # A refusal may also read as a closed connection with nothing served.
            if not got:
                raise ConnectionError("closed without an answer")
            raise AssertionError(f"node B's peer port served a client with {what}: {got[:300]}")

    # Delete rank 0's pod: its RAM tier (an emptyDir) goes with it.
    cluster.kubectl("-n", ns, "delete", "pod", pod_a, "--wait=false")
    saves_a: list[dict[str, Any]] = []

    def gone() -> bool:
        nonlocal saves_a
        current = saved_events(cluster, ns, pod_a)
        if len(current) >= len(saves_a):
            saves_a = current
        return not cluster.kubectl(
            "-n", ns, "get", "pod", pod_a, "--ignore-not-found", check=False
        ).strip()

    wait_for("rank 0's pod deleted", gone, timeout=180)
    deleted = time.monotonic()
    held = held_copies(node_b, pods[1], f"{JOB}-0")
    assert held, "node B holds no copy of rank 0 after the deletion"
    by_step = {e["step"]: e["weights_sha256"] for e in saves_a}

    new = wait_for(
        "the replacement of rank 0 running",
        lambda: (
            (p := job_pods(cluster, ns).get(0))
            and p["metadata"]["name"] != pod_a
            and running(p)
            and p
        ),
        timeout=300,
    )
    assert new["spec"]["nodeName"] == on[0], "the replacement went to another node"

    def rank1_restarted() -> bool:
        # Rank 1's trainer fails with its collective and is restarted in place (its pod and RAM
        # stay); only then is the first `restored` event in its log the one after the loss.
        p = kubectl_json(cluster, "-n", ns, "get", "pod", pod_b)
        return int(container_status(p, "trainer").get("restartCount", 0)) >= 1

    wait_for("rank 1's trainer restarted", rank1_restarted, timeout=300)
    got = wait_for(
        "both ranks restored",
        lambda: (r := {0: restored(cluster, ns, new["metadata"]["name"]),
                       1: restored(cluster, ns, pod_b)})
        and all(r.values()) and r,
        timeout=420,
    )  # fmt: skip
    restore_s = time.monotonic() - deleted
    ev = got[0]
    assert ev["rank"] == 0
    assert ev["tier"] == "peer", (ev, got[1])
    assert ev["step"] == max(held), (ev, sorted(held))
    assert ev["weights_sha256"] == by_step[ev["step"]], (ev, sorted(by_step))
    assert got[1]["tier"] == "ram" and got[1]["step"] == ev["step"], got
    assert got[1]["weights_sha256"] == ev["weights_sha256"]
    wait_for(
        "a save after the restore on both ranks",
        lambda: all(
            any(e["step"] > ev["step"] for e in saved_events(cluster, ns, p))
            for p in (new["metadata"]["name"], pod_b)
        ),
        timeout=240,
    )
    report(
        request,
        f"two nodes: trained and copied in {trained_s:.1f} s; rank 0 restored step {ev['step']} "
        f"from the peer tier (node B's copy) in {ev['seconds']} s, {restore_s:.1f} s after its "
        f"pod was gone; test {time.monotonic() - begin:.1f} s",
    )


# ----------------------------------------------------------------------------- the pair's DNS


def dns_query(port: int, name: str, qtype: int = 1) -> tuple[int, list[str]]:
    """(rcode, A addresses) of one UDP query to 127.0.0.1:``port``."""
    import struct

    qname = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
    packet = struct.pack("!HHHHHH", 0x5AFE, 0x0100, 1, 0, 0, 0) + qname
    packet += struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(10)
        sock.sendto(packet, ("127.0.0.1", port))
        reply = sock.recv(4096)
    qid, flags, _, count = struct.unpack("!HHHH", reply[:8])
    assert qid == 0x5AFE and flags & 0x8000, reply
    # Each answer: name pointer, type, class, TTL, length (12 bytes), then the 4-byte address.
    first = 12 + len(qname) + 4
    ips = [
        socket.inet_ntoa(reply[first + 16 * i + 12 : first + 16 * (i + 1)]) for i in range(count)
    ]
    return flags & 0xF, ips


def test_pair_dns_serves_pod_host_names_from_the_api_and_nothing_else(
    k8s_cluster: LocalCluster, k8s_namespace: str
) -> None:
    """`PodDns` against the real apiserver: a pod's ``<hostname>.<subdomain>.<ns>.svc`` (with or
    without ``.cluster.local``) is its podIP, AAAA is empty, search-list expansions and outside
    names are NXDOMAIN, and a deleted pod's name stops resolving."""
    from e2e.cluster import free_port
    from e2e.node.dns import PodDns

    ns = k8s_namespace
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w-0", "namespace": ns},
        "spec": {
            "hostname": "w-0",
            "subdomain": "sub",
            "nodeName": "no-such-node",  # never runs: its status is written below
            "containers": [{"name": "c", "image": "strata.dev/none:e2e"}],
        },
    }
    k8s_cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(pod))
    k8s_cluster.request(
        f"/api/v1/namespaces/{ns}/pods/w-0/status",
        "PUT",
        {**kubectl_json(k8s_cluster, "-n", ns, "get", "pod", "w-0"),
         "status": {"phase": "Running", "podIP": "10.254.7.9",
                    "podIPs": [{"ip": "10.254.7.9"}]}},
    )  # fmt: skip
    dns = PodDns(k8s_cluster, ["127.0.0.1"], port=free_port())
    dns.start()
    try:
        name = f"w-0.sub.{ns}.svc"
        assert dns_query(dns.port, name) == (0, ["10.254.7.9"])
        assert dns_query(dns.port, name.upper() + ".cluster.local") == (0, ["10.254.7.9"])
        assert dns_query(dns.port, name, qtype=28) == (0, [])  # AAAA: NODATA
        for other in (
            f"{name}.{ns}.svc.cluster.local",  # a search-list expansion
            f"w-1.sub.{ns}.svc",
            f"sub.{ns}.svc",
            "example.com",
        ):
            assert dns_query(dns.port, other) == (3, []), other
        k8s_cluster.kubectl("-n", ns, "delete", "pod", "w-0", "--grace-period=0", "--force")
        assert dns_query(dns.port, name) == (3, [])
    finally:
        dns.stop()
    assert not dns.listening()
