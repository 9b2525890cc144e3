"""TLS for the ext_proc port: a given `tls.crt`/`tls.key` pair, or a fresh self-signed one."""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc


def self_signed_pair(common_name: str = "epp") -> tuple[bytes, bytes]:
    """A new RSA key and a self-signed certificate for it, both PEM (valid one year)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name), x509.DNSName("localhost")]),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_credentials(cert_path: str | None) -> grpc.ServerCredentials:
    """Credentials from `<cert_path>/tls.crt` and `tls.key`, else self-signed; gRPC negotiates h2 via ALPN."""
    if cert_path:
        directory = Path(cert_path)
        key, cert = (directory / "tls.key").read_bytes(), (directory / "tls.crt").read_bytes()
    else:
        key, cert = self_signed_pair()
    return grpc.ssl_server_credentials([(key, cert)])
