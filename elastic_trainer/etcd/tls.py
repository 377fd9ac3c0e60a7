"""Certificates for an etcd that several machines share: a CA, the server's and the nodes'.

``elastic-train etcd certs`` writes them (with the ``cryptography`` library) and prints the flags
each side then needs; ``elastic-train etcd --tls-dir DIR`` serves TLS and accepts only clients
whose certificate the CA signed (etcd's ``--client-cert-auth``):

    elastic-train etcd certs --out etcd-tls --host 10.0.0.5 --host etcd.example --client node
    elastic-train etcd --host 0.0.0.0 --tls-dir etcd-tls                         # on the etcd machine
    elastic-train --rdzv-endpoint 10.0.0.5:2379 \\
        --rdzv-conf protocol=https,ca_cert=etcd-tls/ca.pem,cert=etcd-tls/node.pem,key=etcd-tls/node-key.pem

Keys are written 0600 in a 0700 folder; copy to each node only ``ca.pem`` and its client
certificate and key, and keep ``ca-key.pem`` (which signs new certificates) off the nodes. When
etcd's user authentication is on as well (``--password-file``), etcd takes a client
certificate's common name as the etcd user: the certificates made here are for user ``root``
unless ``--user`` says otherwise.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

CA, SERVER = "ca", "server"


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one TLS folder made by ``make_certs``."""

    folder: Path

    def cert(self, name: str) -> Path:
        return self.folder / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.folder / f"{name}-key.pem"

    def server_flags(self) -> list[str]:
        """etcd's flags: serve TLS with the server certificate, accept only clients the CA signed."""
        return ["--cert-file", str(self.cert(SERVER)), "--key-file", str(self.key(SERVER)),
                "--trusted-ca-file", str(self.cert(CA)), "--client-cert-auth"]

    def rdzv_options(self, client: str) -> dict[str, str]:
        """The rendezvous options of a node that uses client certificate ``client``."""
        return {"protocol": "https", "ca_cert": str(self.cert(CA)), "cert": str(self.cert(client)),
                "key": str(self.key(client))}

    def rdzv_conf(self, client: str) -> str:
        """The ``--rdzv-conf`` of a node that uses client certificate ``client``."""
        return ",".join(f"{k}={v}" for k, v in self.rdzv_options(client).items())

    def check(self) -> None:
        """Raise ``ValueError`` naming the first file that the server needs and that is missing."""
        for path in (self.cert(CA), self.cert(SERVER), self.key(SERVER)):
            if not path.is_file():
                raise ValueError(f"--tls-dir {self.folder}: {path.name} is missing; "
                                 f"make the folder with `elastic-train etcd certs --out {self.folder} --host HOST`")


def _san(host: str):
    from cryptography import x509
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def make_certs(folder: str | Path, hosts: Iterable[str], clients: Iterable[str] = ("client",),
               user: str = "root", days: int = 365) -> TlsFiles:
    """Write a new CA, a server certificate for ``hosts`` (IP addresses or DNS names) and one client
    certificate per name in ``clients`` (common name ``user``) into ``folder``; return its files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID as EKU
    from cryptography.x509.oid import NameOID

    hosts, clients = list(hosts), list(clients)
    if not hosts:
        raise ValueError("give the etcd server's address or name with --host (several: repeat it)")
    files = TlsFiles(Path(folder))
    files.folder.mkdir(parents=True, exist_ok=True)
    files.folder.chmod(0o700)
    now = datetime.now(timezone.utc)
    start, end = now - timedelta(hours=1), now + timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def save(stem: str, cert: x509.Certificate, key) -> None:
        files.cert(stem).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(files.key(stem), key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("elastic-trainer etcd CA")).issuer_name(name("elastic-trainer etcd CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    save(CA, ca, ca_key)

    def leaf(stem: str, cn: str, usage: list, sans: list[str] | None) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in sans]), critical=False)
        save(stem, builder.sign(ca_key, hashes.SHA256()), key)

    # Loopback too: `elastic-train etcd` reaches its own server there (to turn on authentication).
    leaf(SERVER, hosts[0], [EKU.SERVER_AUTH, EKU.CLIENT_AUTH], list(dict.fromkeys([*hosts, "127.0.0.1", "localhost"])))
    for client in clients:
        if client in (CA, SERVER) or not client or "/" in client:
            raise ValueError(f"--client {client!r} must be a plain name other than {CA!r} and {SERVER!r}")
        leaf(client, user, [EKU.CLIENT_AUTH], None)
    return files


__all__ = ["TlsFiles", "make_certs"]
