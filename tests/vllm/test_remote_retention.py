"""Retention decided by the server, followed by vLLM's remote replica (issue 28 item 4).

vLLM 0.33's scheduler with ``KVServiceScheduler`` against a server with the priority
policy and a pinned budget. Mid-run, an operator pins and unpins prefixes through
another client, pins expire on the server's clock, and requests carry priorities with
durations and Dynamo ``cache_control`` pins: the server decides every one of these, and
ships it with the engine's Step answers for the replica to apply at the same boundary.
Every answer of every step is checked against the replica's (a difference stops the
engine), and at the end the server's pins, free blocks and audit agree with the
replica's.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvservice.client import KVClient
from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.testing import (
    VOCAB_SIZE,
    SchedulerSetup,
    block_hasher,
    build_scheduler,
)
from kvservice.server.config import ServerConfig
from tests.servers import server_in_thread
from tests.vllm.scheduler_harness import model_runner_output
from tests.vllm.test_scheduler_differential import _server_config

SETUP = SchedulerSetup(num_blocks=80, max_num_batched_tokens=256, max_model_len=512)
BS = SETUP.block_size


def _config() -> ServerConfig:
    return dataclasses.replace(
        _server_config(SETUP), eviction_policy="priority", max_pinned_fraction=0.3
    )


def _request(rng: random.Random, i: int, prefixes: list[list[int]]) -> Request:
    prefix = rng.choice(prefixes)
    prompt = prefix + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 80))]
    extra: dict[str, Any] | None = None
    roll = rng.random()
    if roll < 0.25:
        extra = {"kvservice_priority": rng.randrange(101), "kvservice_priority_duration": "30ms"}
    elif roll < 0.35:
        extra = {"cache_control": "40ms"}
    elif roll < 0.45:
        extra = {"kvservice_decode_priority": 90}
    params = SamplingParams(max_tokens=rng.randrange(1, 24), extra_args=extra)
    return Request(f"req-{i}", prompt, params, None, block_hasher=block_hasher(BS))


def _run(scheduler: Any, admin: KVClient, seed: int) -> None:
    """Seeded arrivals and steps; the operator pins and unpins between steps."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(BS * n)] for n in (2, 3, 4)]
    pins: list[str] = []
    next_request = 0
    for step in range(400):
        for _ in range(rng.randrange(3)):
            if next_request < 60:
                scheduler.add_request(_request(rng, next_request, prefixes))
                next_request += 1
        if step % 7 == 3:
            prefix = rng.choice(prefixes)
            ttl = rng.choice([0.0, 0.02, 0.05])
            pins.append(admin.pin_prefix(prefix, ttl_s=ttl or None, refresh_on_hit=True).pin_id)
        if step % 11 == 5 and pins:
            pin_id = pins.pop(0)
            if pin_id in {pin.pin_id for pin in admin.list_pins().pins}:
                admin.unpin_prefix(pin_id)
        if next_request >= 60 and not scheduler.has_requests():
            return
        output = scheduler.schedule()
        scheduler.update_from_output(output, model_runner_output(scheduler, output))
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("confirm", ["sync", "overlap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_replica_follows_the_servers_retention_step_for_step(
    confirm: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    with server_in_thread(_config()) as server:
        target = server.handle.target
        monkeypatch.setenv("KVSERVICE_TARGET", target)
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        replica = scheduler.kv_cache_manager.core
        assert replica.priorities_enabled
        with KVClient(target) as admin:
            _run(scheduler, admin, seed)
            # Let the last changes reach both sides: steps with nothing to do still
            # carry the server's clock and its decisions.
            for _ in range(4):
                scheduler.update_from_output(
                    output := scheduler.schedule(), model_runner_output(scheduler, output)
                )
            stats = replica.retention_policy.stats
            assert stats.pins_created > 0 and stats.pinned_block_hits > 0
            assert stats.pins_expired > 0 and stats.priorities_expired > 0
            server_pins = {(p.pin_id, p.num_held_blocks) for p in admin.list_pins().pins}
            replica_pins = {(p.pin_id, len(p.held)) for p in replica.list_pins()}
            assert server_pins == replica_pins
            usage = admin.get_usage()
            assert usage.num_free_blocks == replica.block_pool.get_num_free_blocks()
            scheduler.shutdown()
            assert admin.audit().ok


def test_retention_a_default_server_cannot_serve_is_dropped_not_fatal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Priorities and cache_control pins sent to vLLM's default pool (LRU, no pinned
    budget): each request is served without them (logged), never refused, which would
    stop the engine."""
    with server_in_thread(_server_config(SETUP)) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.handle.target)
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        assert scheduler.kv_cache_manager.core.retention_policy is None
        rng = random.Random(5)
        prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(BS * 2)]]
        for i in range(12):
            request = _request(rng, i, prefixes)
            request.sampling_params.extra_args = {
                "cache_control": "5m",
                "kvservice_priority": 90,
            }
            scheduler.add_request(request)
        while scheduler.has_requests():
            output = scheduler.schedule()
            scheduler.update_from_output(output, model_runner_output(scheduler, output))
        scheduler.shutdown()
        with KVClient(server.handle.target) as client:
            assert client.audit().ok and client.list_pins().pins == ()
