"""Certificates and keys of the local control plane, generated with `cryptography`.

Everything is written as PEM files into one directory:

- ``ca.crt`` / ``ca.key``: the cluster CA (ECDSA P-256, 10 days); it signs every other
  certificate and is the ``--client-ca-file`` of the apiserver and the ``--root-ca-file`` the
  controller-manager publishes in each namespace's ``kube-root-ca.crt`` ConfigMap.
- ``apiserver.crt`` / ``apiserver.key``: serving certificate for 127.0.0.1, ::1, localhost, the
  ``kubernetes.default.svc`` names and the first service IP.
- ``sa.key`` / ``sa.pub``: RSA 2048 service-account signing key pair (RS256 tokens).
- ``<name>.crt`` / ``<name>.key`` for each client identity (admin in ``system:masters``, the
  controller-manager, the scheduler, kwok).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=10)
"""Lifetime of every certificate; a test session or a `make cluster-up` lasts far less."""


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate subject: ``user`` becomes the CN, ``groups`` the O entries."""

    name: str
    user: str
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pki:
    """Paths of the generated PEM files (see the module docstring)."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.directory / "sa.pub"

    def client_cert(self, name: str) -> Path:
        return self.directory / f"{name}.crt"

    def client_key(self, name: str) -> Path:
        return self.directory / f"{name}.key"


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def generate(
    directory: Path,
    clients: list[ClientIdentity],
    service_ip: str = "10.0.0.1",
    extra_serving_ips: tuple[str, ...] = (),
) -> Pki:
    """Create the CA, serving certificate, service-account key pair and client certificates.

    ``extra_serving_ips``: more IP addresses the apiserver's serving certificate names (an
    address clients reach it at besides loopback, e.g. a relay on a node's bridge gateway).
    Overwrites files of the same names in ``directory`` (created when missing). Returns the paths.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "strata-local-ca")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_cert, ca_cert)

    def leaf(
        subject: x509.Name, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(subject, ca_name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    serving_sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
        x509.IPAddress(ipaddress.ip_address(service_ip)),
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_serving_ips),
    ]
    key, cert = leaf(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        ExtendedKeyUsageOID.SERVER_AUTH,
        serving_sans,
    )
    _write_key(pki.serving_key, key)
    _write_cert(pki.serving_cert, cert)

    for client in clients:
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in client.groups]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, client.user))
        key, cert = leaf(x509.Name(attrs), ExtendedKeyUsageOID.CLIENT_AUTH, [])
        _write_key(pki.client_key(client.name), key)
        _write_cert(pki.client_cert(client.name), cert)

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki
