"""vLLM's scheduler as its engine drives it with async scheduling and with speculative
decoding, once with its built-in manager and once with kvservice's, must decide the
same step for step.

Modes: vLLM's ``AsyncScheduler`` with two steps in flight (``KVServiceScheduler``
builds ``KVServiceAsyncScheduler`` when async scheduling is on); synchronous steps with
three draft tokens each, a seeded share accepted; both together; and the drafter
scheduled as EAGLE, synchronous and async (lookahead slots, hits dropping their last
block; remotely on a server started with ``--use-eagle``). In-process on
every setup of the synchronous differential (``test_scheduler_differential.py``), and
remote, confirming in sync and overlap mode; after each remote run the server's audit
passes and every block is back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import vllm

from kvservice.integrations.vllm import KVServiceAsyncScheduler, KVServiceScheduler
from kvservice.integrations.vllm.versions import release
from tests.vllm.async_harness import EngineOrderWorkload
from tests.vllm.scheduler_harness import SchedulerSetup, build_scheduler, first_difference
from tests.vllm.test_scheduler_differential import REFUSED, WORKLOADS, run_remote
from tests.vllm.test_scheduler_differential import SETUPS as SYNC_SETUPS

NUM_DRAFTS = 3
# (steps in flight, draft tokens a step)
MODES = {
    "async": (2, 0),
    "spec": (1, NUM_DRAFTS),
    "async-spec": (2, NUM_DRAFTS),
    "eagle": (1, NUM_DRAFTS),
    "async-eagle": (2, NUM_DRAFTS),
    "eagle-lookahead": (1, NUM_DRAFTS),
    "async-eagle-lookahead": (2, NUM_DRAFTS),
}
# Modes whose drafter is scheduled as EAGLE (``testing.eagle_drafting``): lookahead
# slots for the drafts, hits that drop their last block.
EAGLE_MODES = {"eagle", "async-eagle"}
# vLLM 0.33's EAGLE default: no block dropped, each hash covers the token after its
# block (vLLM 0.32 has no lookahead hashes: these modes run on 0.33 only).
LOOKAHEAD_MODES = {"eagle-lookahead", "async-eagle-lookahead"}
# vLLM 0.32 decides EAGLE hits otherwise: the integration refuses them there.
EAGLE_REFUSED = release(vllm.__version__) == "0.32"
# Draft tokens on a Mamba group need its speculative state blocks (a drafter's own
# config): the speculative modes run on the attention setups.
SPEC_SETUPS = {
    "full",
    "full-no-prefix-caching",
    "preempting",
    "hybrid-full-sliding-window",
    "chunked-prefill",
    "watermark",
    "256-running",
}
CASES = [
    (name, mode)
    for name in SYNC_SETUPS
    if name not in REFUSED
    for mode in MODES
    if (mode == "async" or name in SPEC_SETUPS) and not (mode in LOOKAHEAD_MODES and EAGLE_REFUSED)
]


def setup_for(name: str, mode: str) -> SchedulerSetup:
    batch_queue_size, num_drafts = MODES[mode]
    return dataclasses.replace(
        SYNC_SETUPS[name],
        async_scheduling=batch_queue_size > 1,
        num_speculative_tokens=num_drafts,
        eagle=mode in EAGLE_MODES,
        eagle_lookahead_hashes=mode in LOOKAHEAD_MODES,
    )


def workload(name: str, mode: str, seed: int, **traffic: Any) -> EngineOrderWorkload:
    setup = setup_for(name, mode)
    traffic = {
        "hash_block_size": setup.hash_block,
        "hash_lookahead": setup.hash_lookahead,
        **WORKLOADS.get(name, {}),
        **traffic,
    }
    return EngineOrderWorkload(seed, **traffic).configure(*MODES[mode])


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)


def test_the_named_class_builds_the_async_variant() -> None:
    scheduler = build_scheduler(setup_for("full", "async"), KVServiceScheduler)
    assert type(scheduler) is KVServiceAsyncScheduler
    assert type(build_scheduler(SchedulerSetup(), KVServiceScheduler)) is KVServiceScheduler


@pytest.mark.parametrize(("name", "mode"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_in_process_matches_vllm(name: str, mode: str, seed: int) -> None:
    setup = setup_for(name, mode)
    if mode in EAGLE_MODES and EAGLE_REFUSED and setup.enable_prefix_caching:
        with pytest.raises(NotImplementedError, match="EAGLE drafting with prefix caching"):
            build_scheduler(setup, KVServiceScheduler)
        return
    salts = (None, "tenant-a") if seed else (None,)
    expected = workload(name, mode, seed, salts=salts).run(build_scheduler(setup))
    actual = workload(name, mode, seed, salts=salts).run(build_scheduler(setup, KVServiceScheduler))
    assert first_difference(expected, actual) is None
    if MODES[mode][1]:
        assert any(step["drafts"] for step in actual)  # drafts were verified


REMOTE_CASES = [
    (name, mode, "sync")
    for name, mode in CASES
    if not (mode in EAGLE_MODES and EAGLE_REFUSED and SYNC_SETUPS[name].enable_prefix_caching)
] + [
    (name, mode, "overlap")
    for name in ("preempting", "hybrid-full-sliding-window", "hybrid-full-mamba-align-4x-hash")
    for mode in ("async", "async-spec", "async-eagle")
    if (name, mode) in CASES and not (mode in EAGLE_MODES and EAGLE_REFUSED)
]


@pytest.mark.parametrize(("name", "mode", "confirm"), REMOTE_CASES)
def test_remote_matches_vllm(
    name: str, mode: str, confirm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = setup_for(name, mode)
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    salts = (None, "tenant-a")
    expected = workload(name, mode, 3, salts=salts).run(build_scheduler(setup))
    actual = run_remote(setup, workload(name, mode, 3, salts=salts), monkeypatch)
    assert first_difference(expected, actual) is None


# The server on the engine's own block hashes (--trust-client-block-hashes): drafts,
# async steps in flight, lookahead hashes (each covering the token after its block).
CLIENT_HASH_CASES = [
    (name, mode, confirm)
    for name, mode, confirm in [
        ("full", "async-spec", "sync"),
        ("hybrid-full-sliding-window", "async", "overlap"),
        ("preempting", "eagle-lookahead", "sync"),
        ("hybrid-full-sliding-window", "async-eagle-lookahead", "sync"),
    ]
    if (name, mode) in CASES
]


@pytest.mark.parametrize(("name", "mode", "confirm"), CLIENT_HASH_CASES)
def test_remote_on_the_engines_hashes_matches_vllm(
    name: str, mode: str, confirm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = setup_for(name, mode)
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    monkeypatch.setenv("KVSERVICE_CLIENT_BLOCK_HASHES", "auto")
    salts = (None, "tenant-a")
    expected = workload(name, mode, 3, salts=salts).run(build_scheduler(setup))
    remote = workload(name, mode, 3, salts=salts)
    actual = run_remote(setup, remote, monkeypatch, trust_hashes=True)
    assert first_difference(expected, actual) is None


@pytest.mark.parametrize("where", ["in-process", "remote"])
@pytest.mark.parametrize("mode", ["eagle", "async-eagle"])
def test_an_eagle_drafter_reading_one_group_of_a_hybrid(
    where: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drafter's layers in the full-attention group only (vLLM marks it
    ``is_eagle_group``): hits drop their last block there and not in the window group;
    remotely the server is started with ``--use-eagle --eagle-groups 0``."""
    if EAGLE_REFUSED:
        pytest.skip("vLLM 0.32 decides EAGLE hits otherwise (refused there)")
    setup = dataclasses.replace(setup_for("hybrid-full-sliding-window", mode), eagle_groups=(0,))
    traffic = {"salts": (None, "tenant-a")}
    expected = workload("hybrid-full-sliding-window", mode, 3, **traffic).run(
        build_scheduler(setup)
    )
    if where == "remote":
        actual = run_remote(
            setup, workload("hybrid-full-sliding-window", mode, 3, **traffic), monkeypatch
        )
    else:
        scheduler = build_scheduler(setup, KVServiceScheduler)
        assert scheduler.kv_cache_manager.core.coordinator.eagle_group_ids == {0}
        actual = workload("hybrid-full-sliding-window", mode, 3, **traffic).run(scheduler)
    assert first_difference(expected, actual) is None
