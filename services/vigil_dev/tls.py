"""The secure dev stack's certificates: a certificate authority made on this machine and one
server certificate it signs, for the broker and PostgreSQL (``VIGIL_DEV_SECURE=1``).

Made once per stack folder with the ``cryptography`` library and kept (keys mode 600), so a
restarted stack keeps the CA its clients were given. The server certificate names
``127.0.0.1``, ``::1`` and ``localhost``, which is where the dev stack listens, so clients can
verify the host as in production (librdkafka's ``ssl.endpoint.identification.algorithm=https``,
libpq's ``sslmode=verify-full``). It is good for both ends of a TLS connection (server and
client authentication): the broker presents it to its own controller listener, which asks
for a client certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for any dev stack's life; a stack older than this makes new ones (remove tls/).
VALID_DAYS = 825
RSA_BITS = 2048  # the one key type every client here reads (Java's PEM keystore, libpq, librdkafka)
SERVER_NAMES = ("localhost",)
SERVER_ADDRESSES = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class LocalTLS:
    """``ca.pem`` (what clients trust), ``server.pem`` (certificate) and ``server.key``
    (unencrypted PKCS#8, mode 600) in ``folder``."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def cert(self) -> Path:
        return self.folder / "server.pem"

    @property
    def key(self) -> Path:
        return self.folder / "server.key"

    @property
    def keystore(self) -> Path:
        """The key followed by the certificate in one file: the broker's PEM keystore."""
        return self.folder / "server-keystore.pem"

    def exists(self) -> bool:
        return all(path.exists() for path in (self.ca, self.cert, self.key, self.keystore))

    def ensure(self) -> LocalTLS:
        """Make the CA and the server certificate unless they exist; returns self."""
        if self.exists():
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)
        ca_key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
        # A name of its own: a client given another stack's CA must find no issuer by name.
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"vigil dev stack CA {secrets.token_hex(4)}")])
        ca_cert = (
            _builder(ca_name, ca_name, ca_key, now)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )  # keyCertSign, cRLSign
            .sign(ca_key, hashes.SHA256())
        )
        server_key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
        server_cert = (
            _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), ca_name, server_key, now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        *(x509.DNSName(name) for name in SERVER_NAMES),
                        *(x509.IPAddress(ipaddress.ip_address(a)) for a in SERVER_ADDRESSES),
                    ]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        key_pem = server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        cert_pem = server_cert.public_bytes(serialization.Encoding.PEM)
        write_file(self.key, key_pem, 0o600)
        write_file(self.keystore, key_pem + cert_pem, 0o600)
        write_file(self.cert, cert_pem, 0o644)
        # The CA's key is not kept: nothing signs again; a new stack makes a new CA.
        write_file(self.ca, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return self


def _builder(subject: x509.Name, issuer: x509.Name, key: rsa.RSAPrivateKey, now: datetime.datetime):
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def write_file(path: Path, data: bytes, mode: int) -> None:
    """``data`` into ``path`` with ``mode``, set before anything is written (a file left by an
    older stack keeps its mode otherwise)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as out:
        os.fchmod(out.fileno(), mode)
        out.write(data)
