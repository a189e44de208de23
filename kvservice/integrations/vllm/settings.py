"""Where ``KVServiceKVCacheManager`` gets its blocks, read from the environment.

vLLM builds the scheduler and its manager itself, so the connection cannot be passed
as an argument: ``vllm serve --scheduler-cls kvservice.integrations.vllm.KVServiceScheduler``
plus these variables is the whole configuration.

| variable | meaning |
|---|---|
| ``KVSERVICE_TARGET`` | ``host:port`` of a kvservice server; unset: the core in-process |
| ``KVSERVICE_TOKEN`` | bearer token (an admin tenant's) when the server has tokens |
| ``KVSERVICE_ALLOW_INSECURE_TOKEN`` | ``1``: send the token without TLS anyway |
| ``KVSERVICE_TLS_CA`` | PEM file of the CA to trust: turns TLS on |
| ``KVSERVICE_TLS_CERT`` / ``KVSERVICE_TLS_KEY`` | client certificate and key (mTLS) |
| ``KVSERVICE_SESSION_TTL`` | lease seconds: a dead engine's blocks return after it (default 30) |
| ``KVSERVICE_CLIENT_ID`` | name shown in the server's logs and metrics (default ``vllm-<pid>``) |
| ``KVSERVICE_TIMEOUT`` | seconds a call may take before the scheduler gets an error (30) |
| ``KVSERVICE_CONFIRM`` | ``sync`` (default) or ``overlap``, below |
| ``KVSERVICE_CLIENT_BLOCK_HASHES`` | ``auto`` (default) or ``off``, below |
| ``KVSERVICE_STEP_SOCKET`` | the server's ``--step-socket`` path (same node): steps skip gRPC |

``KVSERVICE_CONFIRM``: with ``sync`` the server confirms each step before the
scheduler's output leaves ``schedule()``; with ``overlap``, before the next step is
planned (the round trip overlaps the forward pass: a step the server then refuses was
executed, and the engine stops before planning another).

``KVSERVICE_CLIENT_BLOCK_HASHES``: with ``auto`` the engine sends vLLM's block hashes
with each request's tokens when the server trusts them (``kvservice serve
--trust-client-block-hashes``, or the tenant's ``trust_client_block_hashes``), and the
server hashes nothing; with ``off`` the server always hashes the tokens itself.

``KVSERVICE_STEP_SOCKET``: the engine's steps (its StepStream) go on the server's step
socket, framed without gRPC, while every other call still goes to ``KVSERVICE_TARGET``
(``kvservice serve --step-socket PATH``; the engine must run on the server's node, as
the server's user).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvservice.client import KVClient

DEFAULT_SESSION_TTL_S = 30.0
DEFAULT_TIMEOUT_S = 30.0
CONFIRM_MODES = ("sync", "overlap")
CLIENT_BLOCK_HASHES = ("auto", "off")


class SettingsError(ValueError):
    """A ``KVSERVICE_*`` variable that cannot be used; the message names it."""


def _read_file(env: Mapping[str, str], name: str) -> bytes | None:
    path = env.get(name)
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise SettingsError(f"{name}={path}: cannot read the file ({error.strerror})") from None


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise SettingsError(f"{name}={raw!r} must be positive")
    return value


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    target: str | None
    token: str | None = None
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    client_id: str = ""
    confirm: str = "sync"
    allow_insecure_token: bool = False
    # Send vLLM's block hashes when the server trusts them (KVSERVICE_CLIENT_BLOCK_HASHES).
    client_block_hashes: bool = True
    # The server's step socket (KVSERVICE_STEP_SOCKET); "": steps go over gRPC.
    step_socket: str = ""

    @property
    def tls(self) -> bool:
        return self.root_certificates is not None

    def connect(self) -> KVClient:
        """A client of the server at ``target``, with these credentials and timeout."""
        assert self.target is not None, "no KVSERVICE_TARGET to connect to"
        return KVClient(
            self.target,
            client_id=self.client_id,
            timeout=self.timeout_s,
            token=self.token,
            tls=self.tls,
            root_certificates=self.root_certificates,
            certificate_chain=self.certificate_chain,
            private_key=self.private_key,
            allow_insecure_token=self.allow_insecure_token,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ConnectionSettings:
        env = os.environ if env is None else env
        target = env.get("KVSERVICE_TARGET") or None
        if target is None:
            return cls(None)
        cert, key = _read_file(env, "KVSERVICE_TLS_CERT"), _read_file(env, "KVSERVICE_TLS_KEY")
        if (cert is None) != (key is None):
            raise SettingsError("KVSERVICE_TLS_CERT and KVSERVICE_TLS_KEY go together (mTLS)")
        confirm = env.get("KVSERVICE_CONFIRM") or "sync"
        if confirm not in CONFIRM_MODES:
            raise SettingsError(f"KVSERVICE_CONFIRM={confirm!r}: use one of {list(CONFIRM_MODES)}")
        hashes = env.get("KVSERVICE_CLIENT_BLOCK_HASHES") or "auto"
        if hashes not in CLIENT_BLOCK_HASHES:
            raise SettingsError(
                f"KVSERVICE_CLIENT_BLOCK_HASHES={hashes!r}: use one of {list(CLIENT_BLOCK_HASHES)}"
            )
        root = _read_file(env, "KVSERVICE_TLS_CA")
        if cert is not None and root is None:
            raise SettingsError("KVSERVICE_TLS_CERT needs KVSERVICE_TLS_CA (the server's CA)")
        token = env.get("KVSERVICE_TOKEN") or None
        allow_insecure_token = env.get("KVSERVICE_ALLOW_INSECURE_TOKEN", "") in ("1", "true")
        if token is not None and root is None and not allow_insecure_token:
            raise SettingsError(
                "KVSERVICE_TOKEN would travel in plaintext: set KVSERVICE_TLS_CA (the "
                "server's CA), or KVSERVICE_ALLOW_INSECURE_TOKEN=1 on a trusted network"
            )
        return cls(
            target=target,
            token=token,
            root_certificates=root,
            certificate_chain=cert,
            private_key=key,
            session_ttl_s=_positive_float(env, "KVSERVICE_SESSION_TTL", DEFAULT_SESSION_TTL_S),
            timeout_s=_positive_float(env, "KVSERVICE_TIMEOUT", DEFAULT_TIMEOUT_S),
            client_id=env.get("KVSERVICE_CLIENT_ID") or f"vllm-{os.getpid()}",
            confirm=confirm,
            allow_insecure_token=allow_insecure_token,
            client_block_hashes=hashes == "auto",
            step_socket=env.get("KVSERVICE_STEP_SOCKET") or "",
        )
