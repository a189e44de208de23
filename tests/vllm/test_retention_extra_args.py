"""Retention per vLLM request (``SamplingParams.extra_args``, which vLLM's OpenAI server
fills from ``vllm_xargs``) on vLLM 0.33's real scheduler with kvservice's manager
in-process: a pinned or high-priority system prompt survives a churn that evicts it
under LRU."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.retention_policy import RetentionConfig, TokenRangeRetention, parse_duration
from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.retention import (
    RequestRetention,
    RetentionSettings,
    request_retention,
)
from kvservice.integrations.vllm.testing import SchedulerSetup, block_hasher, build_scheduler
from tests.vllm.scheduler_harness import Workload, first_difference, model_runner_output
from tests.vllm.test_scheduler_differential import SETUPS

BS = 16
SYSTEM = tuple(range(1, 8 * BS + 1))  # 8 blocks


def test_flat_extra_args_become_a_retention_config_and_a_pin() -> None:
    wanted = request_retention(
        {
            "kvservice_priority": 60,
            "kvservice_priority_duration": "5m",
            "kvservice_priority_ranges": ["0:128:90", "128::70:30s"],
            "kvservice_decode_priority": "10",
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    )
    assert wanted == RequestRetention(
        RetentionConfig(
            (
                TokenRangeRetention(0, None, 60, 300.0),
                TokenRangeRetention(0, 128, 90),
                TokenRangeRetention(128, None, 70, 30.0),
            ),
            decode_priority=10,
        ),
        pin_ttl_s=3600.0,
    )
    assert request_retention({"cache_control": "90"}) == RequestRetention(None, 90.0)
    assert (
        request_retention(None) == request_retention({"temperature_hint": 1}) == RequestRetention()
    )


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"kvservice_priority": 101}, "priority must be in"),
        ({"kvservice_priority": "high"}, "not a whole number"),
        ({"kvservice_priority_ranges": ["0:16"]}, "start:end:priority"),
        ({"kvservice_priority": 50, "kvservice_priority_duration": "-1m"}, "positive"),
        ({"cache_control": {"type": "persistent", "ttl": "5m"}}, "use 'ephemeral'"),
        ({"cache_control": {"type": "ephemeral"}}, "needs a ttl"),
        ({"cache_control": "soon"}, "is not a positive duration"),
    ],
)
def test_malformed_extra_args_name_what_is_wrong(extra_args: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        request_retention(extra_args)


def test_durations_read_as_dynamo_writes_them() -> None:
    assert [parse_duration(v, "ttl") for v in ("300", "300s", "5m", "1.5h", 2)] == [
        300.0,
        300.0,
        300.0,
        5400.0,
        2.0,
    ]


def test_settings_come_from_the_environment() -> None:
    assert not RetentionSettings.from_env({}).enabled
    settings = RetentionSettings.from_env(
        {"KVSERVICE_EVICTION_POLICY": "priority", "KVSERVICE_MAX_PINNED_FRACTION": "0.2"}
    )
    assert settings == RetentionSettings("priority", 0.2) and settings.enabled
    with pytest.raises(ValueError, match="KVSERVICE_EVICTION_POLICY='lfu'"):
        RetentionSettings.from_env({"KVSERVICE_EVICTION_POLICY": "lfu"})
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        RetentionSettings.from_env({"KVSERVICE_MAX_PINNED_FRACTION": "1.5"})


def test_a_remote_pool_takes_its_retention_from_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVICE_TARGET", "127.0.0.1:1")
    monkeypatch.setenv("KVSERVICE_EVICTION_POLICY", "priority")
    with pytest.raises(ValueError, match="a remote pool's is the server's"):
        build_scheduler(SchedulerSetup(), KVServiceScheduler)


# -- the system prompt under churn -------------------------------------------------------


def _request(request_id: str, prompt: tuple[int, ...], extra_args: dict[str, Any] | None) -> Any:
    params = SamplingParams(max_tokens=4, extra_args=extra_args)
    return Request(request_id, list(prompt), params, None, block_hasher=block_hasher(BS))


def _serve(scheduler: Any, request: Any) -> int:
    """Run ``request`` alone to completion; the prompt tokens it found cached."""
    scheduler.add_request(request)
    hit = -1
    while scheduler.has_requests():
        output = scheduler.schedule()
        if hit < 0 and request.request_id in output.num_scheduled_tokens:
            # The whole prompt fits one step: what is not computed was a prefix hit.
            hit = request.num_prompt_tokens - output.num_scheduled_tokens[request.request_id]
        scheduler.update_from_output(output, model_runner_output(scheduler, output))
    return hit


def _system_prompt_hit_after_churn(extra_args: dict[str, Any] | None) -> int:
    scheduler = build_scheduler(SchedulerSetup(num_blocks=41), KVServiceScheduler)
    _serve(scheduler, _request("system", (*SYSTEM, 999), extra_args))
    for i in range(6):
        churn = tuple(1000 + 100 * i + t for t in range(20 * BS))
        _serve(scheduler, _request(f"churn-{i}", churn, None))
    return _serve(scheduler, _request("again", (*SYSTEM, 998), None))


@pytest.mark.parametrize(
    ("env", "extra_args", "hit"),
    [
        ({}, None, 0),
        ({}, {"cache_control": {"type": "ephemeral", "ttl": "5m"}}, 0),  # pinning off
        ({"KVSERVICE_MAX_PINNED_FRACTION": "0.25"}, None, 0),
        ({"KVSERVICE_MAX_PINNED_FRACTION": "0.25"}, {"cache_control": {"ttl": "5m"}}, 8 * BS),
        ({"KVSERVICE_EVICTION_POLICY": "priority"}, {"kvservice_priority": 80}, 8 * BS),
        ({"KVSERVICE_EVICTION_POLICY": "priority"}, {"kvservice_priority": 20}, 0),
    ],
)
def test_a_retained_system_prompt_survives_churn_that_evicts_it_under_lru(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], extra_args: Any, hit: int
) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _system_prompt_hit_after_churn(extra_args) == hit


@pytest.mark.parametrize("name", ["preempting", "hybrid-sliding-window-pressure", "watermark"])
def test_a_pool_with_retention_that_nobody_uses_decides_as_vllm_step_for_step(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The priority policy and a pinned budget, with no request asking for either: every
    step equals vLLM's own LRU manager's."""
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    monkeypatch.setenv("KVSERVICE_EVICTION_POLICY", "priority")
    monkeypatch.setenv("KVSERVICE_MAX_PINNED_FRACTION", "0.3")
    setup = SETUPS[name]
    expected = Workload(0, hash_block_size=setup.hash_block).run(build_scheduler(setup))
    scheduler = build_scheduler(setup, KVServiceScheduler)
    assert scheduler.kv_cache_manager.core.priorities_enabled
    actual = Workload(0, hash_block_size=setup.hash_block).run(scheduler)
    assert first_difference(expected, actual) is None
