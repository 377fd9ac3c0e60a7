"""A throw-away PKI for tests of etcd with TLS: a CA, a server and a client certificate.

    from tests.helpers.tls_certs import make_certs
    certs = make_certs(tmp_path)                 # ca.pem, server.pem, server-key.pem, client.pem, client-key.pem
    certs = make_certs(tmp_path, hosts=["10.77.0.2", "etcd-0.etcd-peer.elastic-trainer.svc"])

The server certificate names ``hosts`` (IP addresses or DNS names) as its subject alternative
names; it is valid for a day either side of now.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path


def make_certs(folder: Path, hosts: Iterable[str] = ("127.0.0.1", "localhost")) -> Path:
    """Write a CA and its server and client certificates (PEM, keys unencrypted) into ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID as EKU
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def san(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    def leaf(name: str, serial: int, usage: list) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(serial)
                .not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([san(h) for h in hosts]), critical=False)
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{name}-key.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    leaf("server", 2, [EKU.SERVER_AUTH, EKU.CLIENT_AUTH])
    leaf("client", 3, [EKU.CLIENT_AUTH])
    return folder
