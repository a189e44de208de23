"""vLLM 0.33's own scheduler, once with its built-in ``KVCacheManager`` and once with
kvservice's, must make the same decisions step for step.

The hybrid full attention + Mamba "align" setups run vLLM's scheduler as it runs a
hybrid model with prefix caching (``mamba_cache_mode="align"``: prefills split where
states are cached, a same-step hit on a state refused until ``new_step_starts``); with
a hash block four times smaller than the blocks, prefix hits end inside blocks and
take copy-on-write copies, whose retained blocks vLLM's scheduler releases after each
step (remotely: the server keeps them until the replica releases them).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest
import vllm

from kvservice.client import KVClient
from kvservice.integrations.vllm import KVServiceScheduler
from kvservice.integrations.vllm.server_link import KVServiceManagerError, ServerLink
from kvservice.integrations.vllm.testing import vllm_config
from kvservice.integrations.vllm.versions import release
from kvservice.server.config import ServerConfig
from tests.servers import server_in_thread
from tests.vllm.scheduler_harness import (
    SchedulerSetup,
    Workload,
    build_scheduler,
    first_difference,
)

SETUPS = {
    "full": SchedulerSetup(),
    "full-no-prefix-caching": SchedulerSetup(enable_prefix_caching=False),
    "preempting": SchedulerSetup(num_blocks=40, max_num_batched_tokens=256, max_model_len=512),
    "hybrid-full-sliding-window": SchedulerSetup(
        num_blocks=160,
        groups=(("full", 16, 0), ("sliding_window", 16, 64)),
        max_model_len=1024,
    ),
    # Admission under pool pressure on a hybrid pool: long prompts whose window group is
    # counted at its admission cap (window + max_in_flight_tokens), not at its length.
    "hybrid-sliding-window-pressure": SchedulerSetup(
        num_blocks=300,
        groups=(("full", 16, 0), ("sliding_window", 16, 256)),
        max_model_len=2048,
        max_num_seqs=16,
    ),
    # A window on every layer (Mistral-style): one sliding-window group, preempting.
    "sliding-window-every-layer": SchedulerSetup(
        num_blocks=30,
        groups=(("sliding_window", 16, 64),),
        max_num_batched_tokens=128,
        max_model_len=512,
    ),
    "chunked-prefill": SchedulerSetup(max_num_batched_tokens=96, long_prefill_token_threshold=40),
    "watermark": SchedulerSetup(num_blocks=60, watermark=0.1, max_model_len=512),
    "256-running": SchedulerSetup(num_blocks=4000, max_num_seqs=256, max_num_batched_tokens=4096),
    "hybrid-full-mamba-align": SchedulerSetup(
        num_blocks=200, groups=(("full", 16, 0), ("mamba", 16, 0))
    ),
    "hybrid-full-mamba-align-4x-hash": SchedulerSetup(
        num_blocks=60,
        groups=(("full", 16, 0), ("mamba", 16, 0)),
        hash_block_size=4,
        max_num_batched_tokens=128,
        max_model_len=512,
    ),
}
# Setups where vLLM 0.32's manager decides otherwise than 0.33's (and kvservice's): the
# integration refuses them on 0.32 (kvservice/integrations/vllm/versions.py).
REFUSED = {
    "0.32": {"hybrid-full-mamba-align", "hybrid-full-mamba-align-4x-hash"},
    "0.33": set(),
}[release(vllm.__version__)]
# Setups whose traces must show copy-on-write copies (partial-block hits).
COPYING = {"hybrid-full-mamba-align-4x-hash"}
# Traffic per setup: 256 running requests need 300 arriving in bursts.
WORKLOADS: dict[str, dict[str, Any]] = {
    "256-running": {
        "num_requests": 320,
        "arrivals_per_step": (60, 100),
        "max_tokens": (100, 200),
        "stop_tokens": False,
        "abort_rate": 0.002,
    },
    # Shared system prompts, repeated prompts and unique ones up to 2000 tokens: prompts
    # longer than the window's cap meet a pool too full for them uncapped.
    "hybrid-sliding-window-pressure": {
        "num_requests": 40,
        "prompt_len": (10, 2000),
        "max_tokens": (1, 300),
        "repeat_rate": 0.3,
    },
}


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)


@pytest.mark.parametrize("name", list(SETUPS))
@pytest.mark.parametrize("seed", [0, 1])
def test_in_process_matches_vllm_step_for_step(name: str, seed: int) -> None:
    setup = SETUPS[name]
    if name in REFUSED:
        with pytest.raises(NotImplementedError, match=f"running vLLM {vllm.__version__}"):
            build_scheduler(setup, KVServiceScheduler)
        return
    salts = (None, "tenant-a") if seed else (None,)
    traffic = {"hash_block_size": setup.hash_block, **WORKLOADS.get(name, {})}
    expected = Workload(seed, salts=salts, **traffic).run(build_scheduler(setup))
    actual = Workload(seed, salts=salts, **traffic).run(build_scheduler(setup, KVServiceScheduler))
    assert first_difference(expected, actual) is None
    if name == "256-running":
        assert max(step["running"] for step in actual) == 256
    if name in COPYING:
        assert sum(len(step["copies"] or ()) for step in actual) > 0


def _word(kind: str, block_size: int, window: int) -> str:
    """A harness group as ``--kv-cache-groups`` writes it."""
    if kind == "sliding_window":
        return f"sliding_window:{window}"
    return f"mamba:{block_size}" if kind == "mamba" else "full_attention"


def _server_config(setup: SchedulerSetup, trust_hashes: bool = False) -> ServerConfig:
    """The server laid out as vLLM lays the setup out (``--kv-cache-groups``);
    ``trust_hashes``: it takes the engine's block hashes (``--trust-client-block-hashes``)."""
    mamba = any(kind == "mamba" for kind, _, _ in setup.groups)
    return ServerConfig(
        kv_cache_groups=",".join(_word(*group) for group in setup.groups),
        hash_block_size=setup.hash_block_size,
        # vLLM zeroes fresh blocks of a pool with Mamba layers; so does the server.
        needs_kv_cache_zeroing=bool(mamba),
        port=0,
        metrics_port=None,
        num_blocks=setup.num_blocks,
        block_size=setup.block_size,
        max_model_len=setup.max_model_len,
        enable_caching=setup.enable_prefix_caching,
        use_eagle=setup.drops_eagle_block,
        eagle_groups=",".join(map(str, setup.eagle_groups)) if setup.drops_eagle_block else "",
        num_hash_lookahead_tokens=setup.hash_lookahead,
        watermark=setup.watermark,
        # What vLLM passes its manager: max_num_batched_tokens per step in flight.
        max_in_flight_tokens=vllm_config(setup).max_in_flight_tokens,
        num_layers=2,
        num_kv_heads=4,
        head_size=16,
        dtype="float16",
        shutdown_grace_s=0,
        trust_client_block_hashes=trust_hashes,
    )


# The setups refused on the running vLLM are checked in-process (the refusal comes
# before any connection).
REMOTE_CASES = [
    case
    for case in [(name, "sync") for name in SETUPS]
    + [
        ("preempting", "overlap"),
        ("hybrid-full-sliding-window", "overlap"),
        ("hybrid-sliding-window-pressure", "overlap"),
        ("sliding-window-every-layer", "overlap"),
        ("hybrid-full-mamba-align-4x-hash", "overlap"),
    ]
    if case[0] not in REFUSED
]


@pytest.mark.parametrize(("name", "confirm"), REMOTE_CASES)
def test_remote_matches_vllm_step_for_step(
    name: str, confirm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    assert_remote_matches_vllm(name, monkeypatch)


def assert_remote_matches_vllm(
    name: str, monkeypatch: pytest.MonkeyPatch, trust_hashes: bool = False, step_socket: str = ""
) -> None:
    """Setup ``name``'s workload decides remotely (``run_remote``) as on vLLM's own
    manager, step for step."""
    setup = SETUPS[name]
    traffic = {"hash_block_size": setup.hash_block, **WORKLOADS.get(name, {})}
    expected = Workload(3, salts=(None, "tenant-a"), **traffic).run(build_scheduler(setup))
    workload = Workload(3, salts=(None, "tenant-a"), **traffic)
    actual = run_remote(setup, workload, monkeypatch, trust_hashes, step_socket)
    assert first_difference(expected, actual) is None


def run_remote(
    setup: SchedulerSetup,
    workload: Any,
    monkeypatch: pytest.MonkeyPatch,
    trust_hashes: bool = False,
    step_socket: str = "",
) -> Any:
    """``workload`` on ``KVServiceScheduler`` against a server with ``setup``'s pool:
    its trace, once the scheduler shut down, the server's audit passed, every block came
    back, and every step took at most one round trip. ``step_socket``: the steps go on
    a step socket at that path (``KVSERVICE_STEP_SOCKET``)."""
    config = dataclasses.replace(_server_config(setup, trust_hashes), step_socket=step_socket)
    with server_in_thread(config) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.handle.target)
        monkeypatch.setenv("KVSERVICE_STEP_SOCKET", step_socket)
        scheduler = build_scheduler(setup, KVServiceScheduler)
        trace = workload.run(scheduler)
        server_link = scheduler.kv_cache_manager.server
        assert server_link is not None
        assert server_link.round_trips <= len(trace)
        scheduler.shutdown()
        connections = server.server.metrics.registry.get_sample_value(
            "kvservice_step_socket_connections_total",
            {"model_name": config.model_name, "engine": str(config.engine)},
        )
        assert connections == (1 if step_socket else 0)
        with KVClient(server.handle.target) as client:
            assert client.audit().ok
            usage = client.get_usage()
            assert (usage.num_requests, usage.num_used_blocks) == (0, 0)
    return trace


# The server takes vLLM's block hashes instead of hashing (--trust-client-block-hashes):
# hash blocks smaller than blocks, windows, preemption, chunked prefills, both modes.
CLIENT_HASH_CASES = [
    case
    for case in [
        ("full", "sync"),
        ("preempting", "overlap"),
        ("hybrid-full-sliding-window", "sync"),
        ("chunked-prefill", "overlap"),
        ("hybrid-full-mamba-align-4x-hash", "sync"),
    ]
    if case[0] not in REFUSED
]


@pytest.mark.parametrize(("name", "confirm"), CLIENT_HASH_CASES)
def test_remote_on_vllms_own_hashes_matches_vllm_step_for_step(
    name: str, confirm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    monkeypatch.setenv("KVSERVICE_CLIENT_BLOCK_HASHES", "auto")
    assert_remote_matches_vllm(name, monkeypatch, trust_hashes=True)


# The steps on the server's step socket (KVSERVICE_STEP_SOCKET), not gRPC: both modes,
# windows, Mamba's partial hits, and the engine's own hashes.
STEP_SOCKET_CASES = [
    case
    for case in [
        ("full", "sync", False),
        ("preempting", "overlap", False),
        ("hybrid-full-sliding-window", "sync", True),
        ("hybrid-full-mamba-align-4x-hash", "overlap", False),
    ]
    if case[0] not in REFUSED
]


@pytest.mark.parametrize(("name", "confirm", "trust_hashes"), STEP_SOCKET_CASES)
def test_remote_on_the_step_socket_matches_vllm_step_for_step(
    name: str, confirm: str, trust_hashes: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVSERVICE_CONFIRM", confirm)
    monkeypatch.setenv("KVSERVICE_CLIENT_BLOCK_HASHES", "auto")
    step_socket = str(tmp_path / "steps.sock")
    assert_remote_matches_vllm(name, monkeypatch, trust_hashes, step_socket)


def test_the_server_decides_on_the_engines_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hashes the engine sends are the ones the server caches by: an engine whose
    every request claims the same chain makes the server find hits its replica does
    not, and the step stops on the difference."""
    real = ServerLink._send_tokens

    def same_chain_for_all(link: ServerLink, request: Any) -> None:
        """Send the request's tokens with the same made-up chain of hashes as every
        other request's (the replica keeps vLLM's: it shares the hashes' list)."""
        hashes = request.block_hashes
        request.block_hashes = [hashlib.sha256(b"%d" % i).digest() for i in range(len(hashes))]
        try:
            real(link, request)
        finally:
            request.block_hashes = hashes

    monkeypatch.setattr(ServerLink, "_send_tokens", same_chain_for_all)
    monkeypatch.setenv("KVSERVICE_CLIENT_BLOCK_HASHES", "auto")
    setup = SETUPS["full"]
    with pytest.raises(KVServiceManagerError, match="the scheduler's replica answered"):
        run_remote(setup, Workload(3, salts=(None, "tenant-a")), monkeypatch, trust_hashes=True)


def test_remote_on_a_smaller_server_pool_decides_as_vllm_on_that_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM computed a larger KV cache than the server's pool: the scheduler uses the
    server's pool, and decides as vLLM's own manager on a pool of that size (so the
    user need not tell vLLM the server's size)."""
    setup = SETUPS["preempting"]
    larger = SchedulerSetup(**{**setup.__dict__, "num_blocks": setup.num_blocks * 3})
    expected = Workload(3).run(build_scheduler(setup))
    assert sum(len(step["preempted"]) for step in expected) > 0
    with server_in_thread(_server_config(setup)) as server:
        monkeypatch.setenv("KVSERVICE_TARGET", server.handle.target)
        scheduler = build_scheduler(larger, KVServiceScheduler)
        manager = scheduler.kv_cache_manager
        assert manager.block_pool.get_num_free_blocks() == setup.num_blocks - 1
        actual = Workload(3).run(scheduler)
        scheduler.shutdown()
        with KVClient(server.handle.target) as client:
            assert client.audit().ok
    assert first_difference(expected, actual) is None


def test_the_comparison_sees_a_manager_that_decides_otherwise() -> None:
    """The traces are rich enough to tell managers apart: one block fewer changes them."""
    setup = SETUPS["preempting"]
    smaller = SchedulerSetup(**{**setup.__dict__, "num_blocks": setup.num_blocks - 1})
    trace = Workload(0).run(build_scheduler(setup))
    assert sum(len(step["preempted"]) for step in trace) > 0
    assert sum(step["stats"][1][3] for step in trace if step["stats"]) > 0  # prefix hits
    assert first_difference(trace, Workload(0).run(build_scheduler(smaller))) is not None
