"""Client credentials of a real node named otherwise than `e2e.cluster.REAL_NODE_NAME`.

The local control plane issues one kubelet identity (``system:node:strata-node``). A second
real node registers under its own name, so it gets its own certificate: CN
``system:node:<name>``, O ``system:nodes``, client auth, signed by the cluster CA (whose key
`e2e.pki.generate` keeps next to its certificate). The files are written into a directory of the
node's own (removed with it); the cluster's PKI directory is not touched.
"""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from e2e import pki as pki_mod

VALIDITY = datetime.timedelta(days=1)
"""Lifetime of a node's certificate; a test module lasts far less."""


def node_client_pki(cluster_pki: pki_mod.Pki, directory: Path, node_name: str) -> pki_mod.Pki:
    """A `Pki` at ``directory`` with the cluster's ``ca.crt`` and a client certificate
    ``kubelet.crt``/``kubelet.key`` for ``system:node:<node_name>``; returns it.

    Raises FileNotFoundError when the cluster's CA key is missing (the cluster was not started).
    """
    directory.mkdir(parents=True, exist_ok=True)
    node_pki = pki_mod.Pki(directory)
    ca_key = serialization.load_pem_private_key(cluster_pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"the cluster CA key {cluster_pki.ca_key} is not an EC key")
    ca_cert = x509.load_pem_x509_certificate(cluster_pki.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node_name}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    shutil.copyfile(cluster_pki.ca_cert, node_pki.ca_cert)
    key_path = node_pki.client_key("kubelet")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    node_pki.client_cert("kubelet").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return node_pki
