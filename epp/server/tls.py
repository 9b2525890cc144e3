"""TLS for the ext_proc port: a given `tls.crt`/`tls.key` pair, or a fresh self-signed one."""

from __future__ import annotations

import datetime
import logging
import ssl
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


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


def server_credentials(cert_path: str | None, *, reload: bool = False) -> grpc.ServerCredentials:
    """Credentials from `<cert_path>/tls.crt` and `tls.key`, else self-signed; gRPC negotiates h2 via ALPN.
    With `reload`, a changed pair is read again at the next new connection (`CertificateReloader`)."""
    if cert_path and reload:
        reloader = CertificateReloader(Path(cert_path))
        return grpc.dynamic_ssl_server_credentials(reloader.initial(), reloader.fetch)
    if cert_path:
        directory = Path(cert_path)
        key, cert = (directory / "tls.key").read_bytes(), (directory / "tls.crt").read_bytes()
    else:
        key, cert = self_signed_pair()
    return grpc.ssl_server_credentials([(key, cert)])


def pair_matches(key_pem: bytes, cert_pem: bytes) -> bool:
    """Whether the PEM private key is the key of the PEM certificate (False when either does not parse)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except (ValueError, TypeError):
        return False
    encoding, form = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(encoding, form) == cert.public_key().public_bytes(encoding, form)


class CertificateReloader:
    """`--enable-cert-reload`: gRPC asks `fetch` at each handshake; it answers a new configuration when
    tls.crt or tls.key changed (a rotated Secret), else None (keep the current one)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._seen: tuple[tuple[int, int, int], ...] = ()

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        # Inode too: a Secret's files are swapped by a symlink flip, which may keep size and mtime.
        stats = [(self.directory / name).stat() for name in ("tls.crt", "tls.key")]
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    def _load(self) -> Any:
        key, cert = (self.directory / "tls.key").read_bytes(), (self.directory / "tls.crt").read_bytes()
        if not pair_matches(key, cert):
            raise ValueError(f"{self.directory}: tls.key is not the key of tls.crt")
        return grpc.ssl_server_certificate_configuration([(key, cert)])

    def initial(self) -> Any:
        """The configuration to start with (reading the pair now; an unreadable pair fails the start)."""
        self._seen = self._stamp()
        return self._load()

    def fetch(self) -> Any:
        """A new configuration if the pair changed since it was last read, else None; a pair caught half
        written or unreadable keeps the current one (the next connection looks again)."""
        try:
            stamp = self._stamp()
            if stamp == self._seen:
                return None
            config = self._load()
        except (OSError, ValueError):  # caught mid-rotation: the next connection looks again
            return None
        self._seen = stamp
        log.warning("TLS: reloaded the certificate pair in %s", self.directory)
        return config


def metrics_ssl_context(cert_dir: str, client_ca_file: str | None = None) -> ssl.SSLContext:
    """TLS (1.2 and up) for the metrics port from `<cert_dir>/tls.crt` and `tls.key`; with `client_ca_file`,
    a client certificate that CA signed is required (llm-d's `--metrics-cert-dir`, `--metrics-client-ca-file`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(Path(cert_dir) / "tls.crt"), str(Path(cert_dir) / "tls.key"))
    if client_ca_file:
        context.load_verify_locations(cafile=client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
