"""TLS material of the operator's HTTPS endpoints (admission webhook and report receiver).

Two sources, in this order:

1. A mounted secret directory (cert-manager's ``Certificate`` secret: ``tls.crt``, ``tls.key``,
   ``ca.crt``), given with ``--tls-dir``. When ``ca.crt`` is missing (a secret written by hand),
   the certificate chain itself is the CA bundle.
2. Otherwise the operator generates, at start, a fresh CA (ECDSA P-256) and a serving certificate
   signed by it with the requested DNS names and IP addresses as SANs, using ``cryptography``
   (never kopf's dev-only self-signing, whose ``oscrypto`` dependency fails with OpenSSL 3).
   Every start makes a new CA: the webhook configuration's ``caBundle`` is rewritten before the
   server accepts requests (C-11), and the report CA is injected into every new pod.

Files are written with mode 0600 (keys) into ``workdir``; :class:`TlsFiles` gives their paths
and the CA bundle (PEM text) that clients (the apiserver, the sidecars) must trust.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from strata.errors import StrataError

GENERATED_VALIDITY = datetime.timedelta(days=365)
"""Lifetime of generated certificates; the operator regenerates them at every start anyway."""


class CertError(StrataError, ValueError):
    """TLS material is missing or unusable; the message names the file and what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the serving certificate chain and key, and the CA bundle clients must trust."""

    certfile: Path
    keyfile: Path
    cafile: Path
    generated: bool

    @property
    def ca_pem(self) -> str:
        return self.cafile.read_text()


def load_or_generate(
    workdir: Path,
    *,
    tls_dir: Path | None = None,
    dns_names: tuple[str, ...] = ("localhost",),
    ip_addresses: tuple[str, ...] = ("127.0.0.1",),
) -> TlsFiles:
    """TLS files from ``tls_dir`` (cert-manager layout) when given, else freshly generated ones.

    ``workdir``: where generated files go (created). Raises :class:`CertError` when ``tls_dir``
    lacks ``tls.crt``/``tls.key`` or they do not parse.
    """
    if tls_dir is not None:
        return load_mounted(tls_dir)
    return generate(workdir, dns_names=dns_names, ip_addresses=ip_addresses)


def load_mounted(tls_dir: Path) -> TlsFiles:
    """Use ``tls.crt``/``tls.key``/``ca.crt`` of a mounted kubernetes.io/tls secret."""
    cert, key, ca = tls_dir / "tls.crt", tls_dir / "tls.key", tls_dir / "ca.crt"
    for path in (cert, key):
        if not path.is_file():
            raise CertError(
                f"{path} is missing: mount a kubernetes.io/tls secret (cert-manager Certificate) "
                "at --tls-dir, or omit --tls-dir to let the operator generate certificates"
            )
    try:
        x509.load_pem_x509_certificates(cert.read_bytes())
        serialization.load_pem_private_key(key.read_bytes(), password=None)
        if ca.is_file():
            x509.load_pem_x509_certificates(ca.read_bytes())
    except ValueError as exc:
        raise CertError(f"unusable TLS material in {tls_dir}: {exc}") from None
    return TlsFiles(
        certfile=cert, keyfile=key, cafile=ca if ca.is_file() else cert, generated=False
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def generate(
    workdir: Path,
    *,
    dns_names: tuple[str, ...] = ("localhost",),
    ip_addresses: tuple[str, ...] = ("127.0.0.1",),
    common_name: str = "strata-operator",
) -> TlsFiles:
    """Generate a CA and a serving certificate for ``dns_names`` + ``ip_addresses`` (SANs).

    Writes ``ca.crt``, ``tls.crt`` (leaf), ``tls.key`` into ``workdir``, replacing old files.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    ca_key, ca_cert = self_signed_ca(
        f"{common_name}-ca {now:%Y%m%dT%H%M%S.%f}", now, GENERATED_VALIDITY
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + GENERATED_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = workdir / "ca.crt", workdir / "tls.crt", workdir / "tls.key"
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(certfile=cert_path, keyfile=key_path, cafile=ca_path, generated=True)


def self_signed_ca(
    common_name: str, start: datetime.datetime, validity: datetime.timedelta
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh P-256 CA (path length 0, cert/CRL signing), valid from ``start`` for ``validity``.

    ``common_name`` is cut to the 64 characters X.509 allows. Used for the webhook's serving CA
    and each job's peer CA (:mod:`strata_operator.admission.peers`)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert
