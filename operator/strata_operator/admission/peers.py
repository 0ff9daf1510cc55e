"""Control-plane side of the peer tier (docs/peers.md): pure builders, no API calls.

- :func:`peer_secret_name` / :func:`peer_secret_data`: the per-job Secret (``kubernetes.io/tls``)
  whose certificate proves membership of one job: a fresh CA (ECDSA P-256) signs one certificate
  with the URI SAN ``strata://job/<job id>`` for server and client auth; the CA key is not kept.
- :func:`workload_peers`: the peer list of a JobSet or an Indexed Job, from the stable pod host
  names the workload controllers give, so that no sidecar needs Kubernetes API access to find its
  peers. JobSet: ``<jobset>-<rjob>-<job index>-<pod index>.<subdomain>``; Indexed Job:
  ``<job>-<index>.<subdomain>`` (the webhook sets the subdomain, the operator creates the headless
  Service of that name).

The webhook/handler wiring is listed in docs/peers.md ("Operator and webhook changes").
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from strata.errors import StrataError
from strata_operator.certs import self_signed_ca

PEER_PORT = 8477
PEER_TLS_MOUNT = "/var/run/secrets/strata.dev/peers"
MAX_PEERS = 4096
"""Most pods one job may have under a ``spec.peers`` policy: the size up to which the peer tier
(placement, inventory polling: every sidecar keeps a client per peer) has been run. A pod's
configuration no longer grows with the job (it carries :func:`workload_peer_ranges`, not the
list), so this bound is the data plane's, not the apiserver's object limit."""
PEER_VALIDITY = datetime.timedelta(days=90)
"""Lifetime of a job's peer certificate; a job running longer needs its Secret re-issued."""


class PeerSpecError(StrataError, ValueError):
    """The workload cannot give stable peer addresses; the message says what to change."""


def job_uri(job_id: str) -> str:
    """Must equal ``strata.peers.transport.job_uri`` (the sidecar checks it)."""
    return f"strata://job/{job_id}"


def peer_secret_name(job_id: str) -> str:
    """``strata-peers-<10 hex of sha256(job id)>``: a valid name whatever the job id's length."""
    return "strata-peers-" + hashlib.sha256(job_id.encode()).hexdigest()[:10]


def peer_secret_data(
    job_id: str, now: datetime.datetime | None = None, validity: datetime.timedelta = PEER_VALIDITY
) -> dict[str, bytes]:
    """PEM ``ca.crt``, ``tls.crt``, ``tls.key`` of a fresh per-job CA and the job's certificate."""
    start = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(minutes=5)
    ca_key, ca = self_signed_ca(f"strata peers CA {job_id}", start, validity)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "strata-peer")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(job_uri(job_id))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        "ca.crt": ca.public_bytes(pem),
        "tls.crt": cert.public_bytes(pem),
        "tls.key": key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }


def _pods_of(job_spec: Mapping[str, Any], what: str) -> int:
    if job_spec.get("completionMode") != "Indexed":
        raise PeerSpecError(
            f"{what}: the peer tier needs stable pod host names: set completionMode: Indexed"
        )
    n = job_spec.get("completions", job_spec.get("parallelism", 1))
    if not isinstance(n, int) or n < 1:
        raise PeerSpecError(f"{what}: completions must be a positive integer, got {n!r}")
    return n


def workload_size(obj: Mapping[str, Any]) -> int:
    """Number of pods (peers) of a JobSet or an Indexed Job, counted without listing them.

    Raises :class:`PeerSpecError` like :func:`workload_peers`.
    """
    kind = obj.get("kind")
    name = (obj.get("metadata") or {}).get("name", "")
    spec = obj.get("spec") or {}
    if kind == "JobSet":
        total = 0
        for rjob in spec.get("replicatedJobs") or []:
            job_spec = (rjob.get("template") or {}).get("spec") or {}
            pods = _pods_of(job_spec, f"JobSet {name} replicatedJob {rjob.get('name')}")
            replicas = rjob.get("replicas", 1)
            if not isinstance(replicas, int) or replicas < 0:
                raise PeerSpecError(
                    f"JobSet {name} replicatedJob {rjob.get('name')}: replicas must be a "
                    f"non-negative integer, got {replicas!r}"
                )
            total += replicas * pods
        return total
    if kind == "Job":
        return _pods_of(spec, f"Job {name}")
    raise PeerSpecError(f"the peer tier supports JobSet and Indexed Job, not {kind}")


def workload_peer_ranges(obj: Mapping[str, Any], port: int = PEER_PORT) -> list[dict[str, Any]]:
    """The pods of a JobSet or an Indexed Job as :class:`strata.peers.config.PeerRange` dicts
    (``obj``: the workload as the API returns it): one range per replicated job (JobSet:
    ``<jobset>-<rjob>-<job index>-<pod index>``) or one for the Job (``<job>-<index>``), each with
    the domain ``<subdomain>.<namespace>.svc`` and ``port``. O(replicated jobs), whatever the
    number of pods: this is what every pod's ``STRATA_CONFIG`` carries.

    Raises :class:`PeerSpecError` for other kinds, non-indexed jobs, a JobSet without DNS
    host names (``spec.network.enableDNSHostnames: false``), or more than :data:`MAX_PEERS`
    pods.
    """
    kind = obj.get("kind")
    meta = obj.get("metadata") or {}
    name, ns = meta.get("name", ""), meta.get("namespace", "default")
    spec = obj.get("spec") or {}
    count = workload_size(obj)
    if count > MAX_PEERS:
        raise PeerSpecError(
            f"{kind} {name} has {count} pods, more than the {MAX_PEERS} peers the peer tier "
            "supports per job; remove spec.peers from the policy for this job, or split it into "
            f"jobs of at most {MAX_PEERS} pods"
        )
    if kind == "JobSet":
        network = spec.get("network") or {}
        if network.get("enableDNSHostnames") is False:
            raise PeerSpecError(
                f"JobSet {name}: spec.network.enableDNSHostnames is false; the peer tier finds "
                "peers by their DNS host names"
            )
        domain = f"{network.get('subdomain') or name}.{ns}.svc"
        ranges = []
        for rjob in spec.get("replicatedJobs") or []:
            job_spec = (rjob.get("template") or {}).get("spec") or {}
            pods = _pods_of(job_spec, f"JobSet {name} replicatedJob {rjob.get('name')}")
            replicas = int(rjob.get("replicas", 1))
            if replicas > 0:
                ranges.append(
                    {
                        "prefix": f"{name}-{rjob['name']}-",
                        "groups": replicas,
                        "count": pods,
                        "domain": domain,
                        "port": port,
                    }
                )
        return ranges
    if kind == "Job":
        pods = _pods_of(spec, f"Job {name}")
        domain = f"{peer_service_name(name)}.{ns}.svc"
        return [{"prefix": f"{name}-", "count": pods, "domain": domain, "port": port}]
    raise PeerSpecError(f"the peer tier supports JobSet and Indexed Job, not {kind}")


def workload_peers(obj: Mapping[str, Any], port: int = PEER_PORT) -> list[dict[str, str]]:
    """``[{"id": host name, "address": "<host>.<subdomain>.<namespace>.svc:<port>"}]`` of every
    pod of a JobSet or an Indexed Job: :func:`workload_peer_ranges` expanded, as the sidecar
    expands them (O(pods); the webhook sends the ranges). Raises like it."""
    out = []
    for r in workload_peer_ranges(obj, port):
        groups = r.get("groups")
        hosts = (
            [f"{r['prefix']}{i}" for i in range(r["count"])]
            if groups is None
            else [f"{r['prefix']}{g}-{i}" for g in range(groups) for i in range(r["count"])]
        )
        out += [{"id": h, "address": f"{h}.{r['domain']}:{r['port']}"} for h in hosts]
    return out


def peer_service_name(job_name: str) -> str:
    """Headless Service (and pod subdomain) the operator creates for an Indexed Job's peers."""
    return f"strata-peers-{job_name}"[:63].rstrip("-")
