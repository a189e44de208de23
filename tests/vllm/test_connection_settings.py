"""``KVSERVICE_*`` variables: each mistake is refused at startup by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvservice.integrations.vllm.settings import ConnectionSettings, SettingsError

TARGET = {"KVSERVICE_TARGET": "127.0.0.1:50051"}


def test_unset_target_means_in_process() -> None:
    assert ConnectionSettings.from_env({}).target is None


def test_defaults() -> None:
    settings = ConnectionSettings.from_env(TARGET)
    assert (settings.session_ttl_s, settings.timeout_s, settings.confirm) == (30.0, 30.0, "sync")
    assert settings.client_id.startswith("vllm-") and not settings.tls


def test_a_token_never_travels_in_plaintext_unless_allowed() -> None:
    with pytest.raises(SettingsError, match="KVSERVICE_TOKEN would travel in plaintext"):
        ConnectionSettings.from_env({**TARGET, "KVSERVICE_TOKEN": "t"})
    allowed = {**TARGET, "KVSERVICE_TOKEN": "t", "KVSERVICE_ALLOW_INSECURE_TOKEN": "1"}
    assert ConnectionSettings.from_env(allowed).allow_insecure_token


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVSERVICE_SESSION_TTL": "soon"}, r"KVSERVICE_SESSION_TTL='soon' is not a number"),
        ({"KVSERVICE_TIMEOUT": "-1"}, r"KVSERVICE_TIMEOUT='-1' must be positive"),
        ({"KVSERVICE_CONFIRM": "later"}, r"KVSERVICE_CONFIRM='later': use one of"),
        (
            {"KVSERVICE_TLS_CA": "/nonexistent/ca.pem"},
            r"KVSERVICE_TLS_CA=/nonexistent/ca.pem: cannot",
        ),
    ],
)
def test_bad_values_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        ConnectionSettings.from_env({**TARGET, **env})


def test_mutual_tls_needs_both_files_and_the_ca(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(b"cert")
    key.write_bytes(b"key")
    with pytest.raises(SettingsError, match="go together"):
        ConnectionSettings.from_env({**TARGET, "KVSERVICE_TLS_CERT": str(cert)})
    with pytest.raises(SettingsError, match="needs KVSERVICE_TLS_CA"):
        ConnectionSettings.from_env(
            {**TARGET, "KVSERVICE_TLS_CERT": str(cert), "KVSERVICE_TLS_KEY": str(key)}
        )
