"""Transport security at startup: TLS/mTLS server credentials and the bind check.

Both run before the server binds, so a bad certificate path or an unsafe bind fails
``kvservice serve`` with exit code 2 and a message naming the setting.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from pathlib import Path
from typing import Any

import grpc
import structlog

from kvservice.core.errors import InvalidArgumentError
from kvservice.server.config import ServerConfig

log = structlog.get_logger("kvservice.security")

ALLOW_INSECURE_BIND_FLAG = "--allow-insecure-bind"


class SecurityConfigError(InvalidArgumentError):
    """A TLS, token or bind setting that cannot be used; raised at startup only."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine. Wildcards
    (``0.0.0.0``, ``::``, ``[::]``) and names other than ``localhost`` do not."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _read(path: str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise SecurityConfigError(f"{setting} {path}: {err.strerror}") from None
    if not data.strip():
        raise SecurityConfigError(f"{setting} {path}: the file is empty")
    return data


def server_credentials(config: ServerConfig) -> Any:
    """``grpc.ServerCredentials`` for the configured TLS files, or None for plaintext.

    ``tls_client_ca_file`` turns on mutual TLS: a client must present a certificate
    signed by that CA or its handshake fails (the client sees UNAVAILABLE).
    """
    cert, key, client_ca = config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
    if (cert is None) != (key is None):
        raise SecurityConfigError(
            "tls_cert_file and tls_key_file go together: set both (TLS) or neither "
            f"(plaintext); got tls_cert_file={cert!r}, tls_key_file={key!r}"
        )
    if cert is None or key is None:
        if client_ca is not None:
            raise SecurityConfigError(
                f"tls_client_ca_file={client_ca!r} needs tls_cert_file and tls_key_file: "
                f"mutual TLS is TLS with client certificates"
            )
        return None
    pair = (_read(key, "tls_key_file"), _read(cert, "tls_cert_file"))
    roots = _read(client_ca, "tls_client_ca_file") if client_ca is not None else None
    # gRPC would report any of these as "Failed to bind": check them first, naming
    # the file.
    _check_pem(pair[1], _CERTIFICATE, "tls_cert_file", cert)
    _check_pem(pair[0], _PRIVATE_KEY, "tls_key_file", key)
    if roots is not None and client_ca is not None:
        _check_pem(roots, _CERTIFICATE, "tls_client_ca_file", client_ca)
    _check_pair(cert, key, client_ca)
    return grpc.ssl_server_credentials(
        [pair], root_certificates=roots, require_client_auth=roots is not None
    )


_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")


def _check_pem(data: bytes, marker: re.Pattern[bytes], setting: str, path: str) -> None:
    if marker.search(data) is None:
        kind = "certificate" if marker is _CERTIFICATE else "private key"
        raise SecurityConfigError(
            f"{setting} {path} is not a PEM {kind} (no '{marker.pattern.decode()}' block)"
        )


def _check_pair(cert: str, key: str, client_ca: str | None) -> None:
    """Load the files as OpenSSL will: a key that is not the certificate's, or a file
    OpenSSL cannot parse, named in one line."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key would make OpenSSL prompt on the terminal: answer "" (gRPC
        # takes unencrypted keys only).
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as err:
        if "KEY_VALUES_MISMATCH" in str(err):
            raise SecurityConfigError(
                f"tls_key_file {key} does not match tls_cert_file {cert}: it is the key of "
                f"another certificate"
            ) from None
        raise SecurityConfigError(
            f"tls_cert_file {cert} with tls_key_file {key}: OpenSSL cannot load them "
            f"({err.reason or err}); both must be PEM, the key unencrypted"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as err:
            raise SecurityConfigError(
                f"tls_client_ca_file {client_ca}: OpenSSL cannot load it as PEM CA "
                f"certificates ({err.reason or err})"
            ) from None


def check_bind(config: ServerConfig, has_tokens: bool) -> None:
    """Refuse to serve a non-loopback address unprotected.

    Safe off loopback means TLS plus a way to tell clients apart: bearer tokens or
    client certificates (mTLS). Tokens without TLS would cross the network in clear
    text, and TLS alone lets anyone who reaches the port in. Anything less needs
    ``allow_insecure_bind`` and is logged as a warning.
    """
    if is_loopback(config.host):
        return
    has_tls = config.tls_cert_file is not None
    has_client_auth = has_tokens or config.tls_client_ca_file is not None
    if has_tls and has_client_auth:
        return
    missing = "TLS" if not has_tls else "client authentication (auth_tokens_file or mTLS)"
    if not config.allow_insecure_bind:
        raise SecurityConfigError(
            f"refusing to serve gRPC on non-loopback address {config.host!r} without "
            f"{missing}: set tls_cert_file/tls_key_file and auth_tokens_file (or "
            f"tls_client_ca_file), or pass {ALLOW_INSECURE_BIND_FLAG} "
            f"(KVSERVICE_ALLOW_INSECURE_BIND=1) to accept the risk"
        )
    log.warning(
        "insecure bind",
        host=config.host,
        missing=missing,
        detail=f"anyone who can reach this address can use the pool ({ALLOW_INSECURE_BIND_FLAG})",
    )


def check_step_socket(config: ServerConfig, has_tokens: bool) -> None:
    """Refuse a step socket where it would be a way around client certificates: it
    has no TLS, so on a server that authenticates clients by certificate alone
    (``tls_client_ca_file`` without ``auth_tokens_file``) only the socket file's mode
    would stand between a local process and the pool."""
    if config.step_socket and config.tls_client_ca_file is not None and not has_tokens:
        raise SecurityConfigError(
            f"--step-socket {config.step_socket} has no TLS, so it would let a client in "
            "without the certificate tls_client_ca_file requires: set auth_tokens_file "
            "too (the step socket's hello then carries a token), or serve steps over "
            "gRPC (--unix-socket keeps TLS)"
        )
