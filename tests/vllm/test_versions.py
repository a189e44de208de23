"""The vLLM releases the integration accepts, and what it refuses on each."""

from __future__ import annotations

import re

import pytest
import vllm

from kvservice.integrations.vllm.testing import SchedulerSetup, build_scheduler
from kvservice.integrations.vllm.versions import SUPPORTED, check_release, release


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.33.0", "0.33"), ("0.32.0+cpu", "0.32"), ("0.33.1rc1", "0.33"), ("1.0.0", "1.0")],
)
def test_a_release_is_its_major_and_minor(version: str, expected: str) -> None:
    assert release(version) == expected


def test_the_running_vllm_is_supported() -> None:
    assert release(vllm.__version__) in SUPPORTED
    check_release(vllm.__version__)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_an_untested_release_is_refused_by_name(version: str) -> None:
    with pytest.raises(
        NotImplementedError, match=f"supports vLLM 0.32 and 0.33, not vLLM {re.escape(version)}"
    ):
        check_release(version)


def test_the_kvservice_scheduler_refuses_an_untested_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvservice.integrations.vllm import KVServiceScheduler, manager  # noqa: PLC0415

    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    monkeypatch.setattr(manager, "vllm_version", "0.34.0")
    with pytest.raises(NotImplementedError, match=r"not vLLM 0\.34\.0"):
        build_scheduler(SchedulerSetup(), KVServiceScheduler)
