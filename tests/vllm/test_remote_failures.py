"""The remote manager's failures: each is a clear exception naming the server and the
call, never a local fallback, and never a silent divergence."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from vllm.config import SchedulerConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvservice.bench.server import free_port
from kvservice.client import InvalidArgumentError, KVClient
from kvservice.integrations.vllm import KVServiceKVCacheManager, KVServiceScheduler
from kvservice.integrations.vllm.server_link import (
    KVServiceManagerError,
    ServerConfigMismatchError,
)
from kvservice.integrations.vllm.testing import (
    SchedulerSetup,
    block_hasher,
    build_scheduler,
    kv_cache_config,
)
from kvservice.server.config import ServerConfig, build_kv_cache_config
from tests.server.support import wait_for_blocks_back
from tests.servers import ThreadedServer, server_in_thread
from tests.vllm.scheduler_harness import RequestSpec, Workload, model_runner_output

SETUP = SchedulerSetup(num_blocks=64, max_model_len=512)
POOL = ServerConfig(
    port=0,
    metrics_port=None,
    num_blocks=64,
    block_size=16,
    max_model_len=512,
    num_layers=2,
    num_kv_heads=4,
    head_size=16,
    dtype="float16",
    shutdown_grace_s=0,
    session_ttl_min_s=0.5,
)


@contextmanager
def remote(
    monkeypatch: pytest.MonkeyPatch, config: ServerConfig = POOL
) -> Iterator[ThreadedServer]:
    with server_in_thread(config) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.handle.target)
        yield server


def _admit(scheduler: KVServiceScheduler, count: int = 3) -> None:
    for i in range(count):
        spec = RequestSpec(f"held-{i}", tuple(range(40 + i)), max_tokens=100)
        scheduler.add_request(spec.build(SETUP.block_size))
    output = scheduler.schedule()
    scheduler.update_from_output(output, model_runner_output(scheduler, output))


def test_vllm_resolves_the_scheduler_class_by_name() -> None:
    config = SchedulerConfig(
        max_model_len=512,
        is_encoder_decoder=False,
        scheduler_cls="kvservice.integrations.vllm.KVServiceScheduler",
    )
    assert config.get_scheduler_cls() is KVServiceScheduler


def test_an_unreachable_server_fails_startup_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    target = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("KVSERVICE_TARGET", target)
    monkeypatch.setenv("KVSERVICE_TIMEOUT", "5")
    with pytest.raises(KVServiceManagerError, match=rf"kvservice at {target}: GetCacheConfig"):
        build_scheduler(SETUP, KVServiceScheduler)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_blocks": 80}, r"num_blocks: vLLM 64, kvservice 80 .*--num-blocks 64 or fewer"),
        (
            {"block_size": 32},
            r"block sizes: vLLM \[16\], kvservice \[32\] \(start kvservice with --block-size 16\)",
        ),
        ({"watermark": 0.1}, r"watermark blocks: vLLM 0, kvservice 6"),
        ({"hash_algo": "sha256_cbor"}, r"hash algorithm: vLLM sha256, kvservice sha256_cbor"),
        (
            {"none_hash_seed": "other"},
            r"hash seed: vLLM 'vllm-none-hash', kvservice 'other' \(from explicit",
        ),
        (
            {"hash_algo": "xxhash"},
            r"hash algorithm: vLLM sha256, kvservice xxhash; hash seed: kvservice draws a "
            r"random seed",
        ),
        (
            {"sliding_window": 64, "num_blocks": 100},
            r"KV cache groups: vLLM full_attention, kvservice full_attention,sliding_window:64 "
            r"\(start kvservice with --kv-cache-groups full_attention\)",
        ),
        (
            {"max_model_len": 256},
            r"max_model_len: vLLM 512, kvservice 256 .*--max-model-len 512, or give vLLM "
            r"--max-model-len 256",
        ),
        (
            {"num_hash_lookahead_tokens": 1},
            r"lookahead tokens each block hash covers .*: vLLM 0, kvservice 1 \(start "
            r"kvservice with --num-hash-lookahead-tokens 0\)",
        ),
    ],
)
def test_a_server_of_another_layout_fails_startup_naming_both_values(
    monkeypatch: pytest.MonkeyPatch, override: dict[str, Any], message: str
) -> None:
    config = dataclasses.replace(POOL, **override)
    with remote(monkeypatch, config), pytest.raises(ServerConfigMismatchError, match=message):
        build_scheduler(SETUP, KVServiceScheduler)


def test_a_window_pool_retaining_otherwise_fails_startup_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which out-of-window blocks stay cached decides which free blocks come first: a
    server retaining otherwise than vLLM (a real engine's default is 0) would hand out
    other blocks, so it is refused at startup, with the value to start it with."""
    setup = SchedulerSetup(num_blocks=64, max_model_len=512, groups=(("sliding_window", 16, 64),))
    config = dataclasses.replace(
        POOL, kv_cache_groups="sliding_window:64", prefix_cache_retention_interval=0
    )
    with (
        remote(monkeypatch, config),
        pytest.raises(
            ServerConfigMismatchError,
            match=r"prefix cache retention interval .*: vLLM None, kvservice 0 \(start "
            r"kvservice without --prefix-cache-retention-interval\)",
        ),
    ):
        build_scheduler(setup, KVServiceScheduler)


def test_a_server_hashing_other_blocks_fails_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid Mamba pool hashed every 4 tokens (partial-block hits) serves no vLLM
    that hashes every 16: the hash block size is part of the layout checked."""
    setup = SchedulerSetup(
        num_blocks=64, max_model_len=512, groups=(("full", 16, 0), ("mamba", 16, 0))
    )
    config = dataclasses.replace(POOL, mamba_block_size=16, hash_block_size=4)
    with (
        remote(monkeypatch, config),
        pytest.raises(
            ServerConfigMismatchError,
            match=r"hash block size: vLLM 16, kvservice 4 \(start kvservice with "
            r"--hash-block-size 16",
        ),
    ):
        build_scheduler(setup, KVServiceScheduler)


# A hybrid pool whose window group vLLM's admission gate counts for at most the window
# plus max_in_flight_tokens (max_num_batched_tokens, 128 here): 13 blocks, not 33.
WINDOW_SETUP = SchedulerSetup(
    num_blocks=100,
    max_model_len=512,
    max_num_batched_tokens=128,
    groups=(("full", 16, 0), ("sliding_window", 16, 64)),
)
WINDOW_POOL = dataclasses.replace(POOL, num_blocks=100, sliding_window=64)


def test_a_server_counting_windows_otherwise_at_admission_fails_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server bounding the window group's admission count otherwise than vLLM (here
    by its max_model_len, its default) would refuse admissions the replica makes under
    pool pressure: startup names both and the flag."""
    with (
        remote(monkeypatch, WINDOW_POOL),
        pytest.raises(
            ServerConfigMismatchError,
            match=r"admission blocks per request of the window-bounded groups \(from "
            r"max_in_flight_tokens\): vLLM \[None, 13\] from 128, kvservice \[None, 33\] "
            r"from 512 \(start kvservice with --max-in-flight-tokens 128\)",
        ),
    ):
        build_scheduler(WINDOW_SETUP, KVServiceScheduler)


@pytest.mark.parametrize(
    ("setup_override", "pool_override"),
    [
        ({}, {"max_in_flight_tokens": 128}),
        # Both bounds lie past the blocks of vLLM's max_model_len (32): 33 blocks for
        # vLLM (2048 tokens in flight, 512 at most), 65 for the server (its 1024).
        (
            {"max_num_batched_tokens": 2048, "num_blocks": 140},
            {"max_model_len": 1024, "num_blocks": 140},
        ),
    ],
)
def test_a_server_counting_windows_as_vllm_starts(
    monkeypatch: pytest.MonkeyPatch,
    setup_override: dict[str, Any],
    pool_override: dict[str, Any],
) -> None:
    setup = dataclasses.replace(WINDOW_SETUP, **setup_override)
    with remote(monkeypatch, dataclasses.replace(WINDOW_POOL, **pool_override)):
        scheduler = build_scheduler(setup, KVServiceScheduler)
        scheduler.shutdown()


def test_a_lost_server_stops_the_scheduler_with_the_step_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with remote(monkeypatch) as server:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        _admit(scheduler)
        target = server.handle.target
    # The server is gone: the next step's confirmation fails, before its output is used.
    with pytest.raises(
        KVServiceManagerError, match=rf"kvservice at {target}: Step of \d+ operations"
    ):
        scheduler.schedule()
    with pytest.raises(KVServiceManagerError, match="stopped after an earlier failure"):
        scheduler.schedule()


def test_with_overlap_a_lost_server_stops_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSERVICE_CONFIRM", "overlap")
    with remote(monkeypatch) as server:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        _admit(scheduler)
        output = scheduler.schedule()  # sent, its answer not waited for
        target = server.handle.target
    # The step was sent before the server went: whether its answer came back or the
    # next send fails, no later step is planned without a confirmed predecessor.
    scheduler.update_from_output(output, model_runner_output(scheduler, output))
    with pytest.raises(KVServiceManagerError, match=rf"kvservice at {target}"):
        scheduler.schedule()
        scheduler.schedule()


def test_another_writer_on_the_pool_is_detected_not_absorbed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with remote(monkeypatch) as server:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        with KVClient(server.handle.target) as intruder:
            intruder.add_request("intruder", list(range(200)))
            assert intruder.allocate_slots("intruder", 200) is not None
        with pytest.raises(KVServiceManagerError, match="Is another client using this pool"):
            Workload(5, num_requests=20).run(scheduler)


def test_another_writer_is_named_at_the_decode_allocation_it_diverts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The running requests' allocations are checked in bulk; the one the server
    answered otherwise is named, with both answers."""
    with remote(monkeypatch) as server:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        _admit(scheduler)
        with KVClient(server.handle.target) as intruder:
            intruder.add_request("intruder", list(range(16)))
            assert intruder.allocate_slots("intruder", 16) is not None
        with pytest.raises(
            KVServiceManagerError,
            match=r"answered allocate_slots\('held-\d', 1\) with \(\(\d+,\),\); the "
            r"scheduler's replica answered \(\(\d+,\),\)\. Is another client",
        ):
            for _ in range(16):  # each request takes a fourth block within 9 steps
                output = scheduler.schedule()
                scheduler.update_from_output(output, model_runner_output(scheduler, output))


def test_another_writer_is_named_at_the_admission_it_diverts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiting request's lookup and allocation travel together and are checked in
    bulk; a prefix another client cached makes the server's lookup hit where the
    replica's missed, and that admission is named, with both answers."""
    with remote(monkeypatch) as server:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        _admit(scheduler)
        prompt = tuple(range(1000, 1064))
        with KVClient(server.handle.target) as intruder:
            intruder.add_request("intruder", list(prompt))
            assert intruder.allocate_slots("intruder", len(prompt)) is not None
        scheduler.add_request(RequestSpec("late", (*prompt, 7), max_tokens=4).build(16))
        with pytest.raises(
            KVServiceManagerError,
            match=r"answered get_computed_blocks\('late'\) then allocate_slots\('late', 65\) "
            r"attaching its hit with ComputedBlocks\(block_ids=\(\(\d+, \d+, \d+, \d+\),\), "
            r"num_computed_tokens=64.*; the scheduler's replica answered ComputedBlocks\(",
        ):
            scheduler.schedule()


def test_a_second_engine_on_a_held_pool_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVICE_SESSION_TTL", "0.5")
    with remote(monkeypatch):
        first = build_scheduler(SETUP, KVServiceScheduler)
        _admit(first)
        with pytest.raises(KVServiceManagerError, match=r"still holds \d+ blocks for 3 requests"):
            build_scheduler(SETUP, KVServiceScheduler)
        first.shutdown()
        # Once the first engine is gone, a new one takes the pool over.
        second = build_scheduler(SETUP, KVServiceScheduler)
        assert second.kv_cache_manager.server is not None
        second.shutdown()


_ENGINE = textwrap.dedent(
    """
    import sys, time
    import tests.vllm  # noqa: F401  (vLLM's CPU environment)
    from kvservice.integrations.vllm import KVServiceScheduler
    from kvservice.integrations.vllm.testing import SchedulerSetup, build_scheduler
    from tests.vllm.test_remote_failures import SETUP, _admit

    scheduler = build_scheduler(SETUP, KVServiceScheduler)
    _admit(scheduler)
    print("admitted", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_engine_gets_its_blocks_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with remote(monkeypatch) as server, KVClient(server.handle.target) as client:
        env = {**os.environ, "KVSERVICE_SESSION_TTL": "1"}
        engine = subprocess.Popen(
            [sys.executable, "-c", _ENGINE], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert engine.stdout is not None
            assert engine.stdout.readline().strip() == "admitted"
            held = client.get_usage()
            assert held.num_requests == 3 and held.num_used_blocks > 0
            engine.kill()
            engine.wait()
            wait_for_blocks_back(client)
        finally:
            engine.kill()
            engine.wait()


def test_shutdown_ends_the_engines_session_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler shut down ends its session (CloseSession) and frees what it held
    right away, not when its 30 s lease would run out."""
    with remote(monkeypatch) as server, KVClient(server.handle.target) as client:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        _admit(scheduler)
        assert client.audit().num_sessions == 1
        assert client.get_usage().num_used_blocks > 0
        scheduler.shutdown()
        report = client.audit()
        assert report.ok and report.num_sessions == 0
        usage = client.get_usage()
        assert (usage.num_requests, usage.num_used_blocks) == (0, 0)


@pytest.mark.parametrize(
    ("engine_eagle", "server_eagle", "message"),
    [
        (
            True,
            False,
            r"EAGLE drafting: vLLM on, kvservice off \(start kvservice with --use-eagle\)",
        ),
        (False, True, r"EAGLE drafting: vLLM off, kvservice on \(start kvservice without"),
    ],
)
def test_an_eagle_engine_needs_an_eagle_pool(
    monkeypatch: pytest.MonkeyPatch, engine_eagle: bool, server_eagle: bool, message: str
) -> None:
    """An EAGLE drafter's hits drop their last block: an engine and a server that
    disagree would answer other hits, so startup names the flag."""
    config = dataclasses.replace(POOL, use_eagle=server_eagle)
    with remote(monkeypatch, config), pytest.raises(ServerConfigMismatchError, match=message):
        KVServiceKVCacheManager(
            kv_cache_config=kv_cache_config(SETUP),
            max_model_len=SETUP.max_model_len,
            scheduler_block_size=SETUP.block_size,
            hash_block_size=SETUP.block_size,
            use_eagle=engine_eagle,
        )


def test_a_capped_lookup_is_served_remotely_as_vllm_caps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``max_cache_hit_length`` (its routed-experts output connector caps a
    hit) reaches the server, which caps its hit alike; a negative cap is refused."""
    hasher = block_hasher(SETUP.block_size)
    prompt = list(range(1, 70))

    def request(request_id: str) -> Request:
        return Request(
            request_id, list(prompt), SamplingParams(max_tokens=1), None, block_hasher=hasher
        )

    with remote(monkeypatch) as server:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        manager = scheduler.kv_cache_manager
        first = request("first")
        manager.new_step_starts()
        assert manager.allocate_slots(first, first.num_tokens)
        manager.take_kv_cache_block_copies()
        for cap, expected in ((40, 32), (16, 16), (0, 0)):
            again = request(f"again-{cap}")
            manager.new_step_starts()
            blocks, num_hit, _ = manager.get_computed_blocks(again, max_cache_hit_length=cap)
            assert num_hit == expected
            assert manager.allocate_slots(
                again, again.num_tokens - num_hit, num_hit, blocks if num_hit else None
            )
            # The step goes to the server, which must answer the capped lookup alike.
            manager.take_kv_cache_block_copies()
        assert manager.server is not None and manager.server.round_trips == 4
        scheduler.shutdown()
        with KVClient(server.handle.target) as client:
            client.add_request("direct", prompt)
            with pytest.raises(InvalidArgumentError, match="max_cache_hit_length must be >= 0"):
                client.get_computed_blocks("direct", max_cache_hit_length=-1)
            assert (
                client.get_computed_blocks("direct", max_cache_hit_length=20).num_computed_tokens
                == 16
            )
            assert client.audit().ok


def test_an_eagle_drafter_on_some_groups_names_them_at_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM marks the groups holding draft layers; a server dropping blocks in every
    group would answer other hits: refused, naming --eagle-groups."""
    setup = SchedulerSetup(
        num_blocks=100,
        max_model_len=512,
        groups=(("full", 16, 0), ("sliding_window", 16, 64)),
        eagle_groups=(0,),
    )
    config = dataclasses.replace(
        POOL, num_blocks=100, kv_cache_groups="full_attention,sliding_window:64", use_eagle=True
    )
    with (
        remote(monkeypatch, config),
        pytest.raises(
            ServerConfigMismatchError,
            match=re.escape(
                "EAGLE drafter groups: vLLM [0], kvservice [0, 1] (start kvservice with "
                "--use-eagle --eagle-groups 0)"
            ),
        ),
    ):
        KVServiceKVCacheManager(
            kv_cache_config=kv_cache_config(setup),
            max_model_len=setup.max_model_len,
            scheduler_block_size=16,
            hash_block_size=16,
            use_eagle=True,
        )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"eagle_groups": "0"}, "add --use-eagle"),
        ({"eagle_groups": "0,x", "use_eagle": True}, "write group indices"),
        ({"eagle_groups": "3", "use_eagle": True}, "the pool has groups 0..0"),
    ],
)
def test_bad_eagle_groups_are_refused(override: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_kv_cache_config(dataclasses.replace(POOL, **override))


def test_a_new_request_the_server_refuses_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """New requests travel in a column (AddRequestBatch); one the server refuses (here
    another client took its id first) stops the scheduler, naming the request and the
    server's words."""
    with remote(monkeypatch) as server:
        scheduler = build_scheduler(SETUP, KVServiceScheduler)
        _admit(scheduler)
        with KVClient(server.handle.target) as intruder:
            intruder.add_request("late", [1, 2, 3])
        scheduler.add_request(RequestSpec("late", tuple(range(40)), max_tokens=4).build(16))
        with pytest.raises(
            KVServiceManagerError, match=r"refused add_request\('late', <40 tokens>\): .*'late'"
        ):
            scheduler.schedule()
