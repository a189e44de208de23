"""``OffloadStep``: an engine's CPU offload tier index served by kvservice. A replica
``OffloadIndex`` driven through ``OffloadLink`` (as vLLM's offloading manager drives
it) agrees with the server's index call for call, whatever the policy; a malformed
message is refused before anything runs; an operation answered otherwise stops the
index and names itself; the index is the session's and goes with it."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvservice.client import KVClient
from kvservice.client.errors import FailedPreconditionError, InvalidArgumentError
from kvservice.client.offload_link import (
    UNKNOWN_POSITION,
    OffloadLink,
    OffloadLinkError,
    OffloadTierConfig,
)
from kvservice.core.errors import QuotaExceededError
from kvservice.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvservice.core.offload_index import OffloadIndex, RequestAccess
from kvservice.protocol.gen import kv_cache_service_pb2 as pb
from tests.server.fuzz_support import fuzz_settings
from tests.server.support import SMALL_POOL
from tests.servers import ThreadedServer, server_in_thread

NUM_CHUNKS = 12


def key(block: int, group: int = 0) -> bytes:
    return block.to_bytes(32, "big") + group.to_bytes(4, "big")


def config(policy: str = "lru", **fields: int | bool) -> pb.OffloadTierConfig:
    pinned = NUM_CHUNKS // 2 if policy == "priority" else 0
    values = {
        "num_chunks": NUM_CHUNKS,
        "eviction_policy": policy,
        "max_tracker_size": 64,
        "enable_events": True,
        "max_pinned_chunks": pinned,
        "bytes_per_chunk": 4096,
        **fields,
    }
    return pb.OffloadTierConfig(**values)  # type: ignore[arg-type]


def settings(tier: pb.OffloadTierConfig) -> OffloadTierConfig:
    """The client's form of ``tier``."""
    fields = OffloadTierConfig.__dataclass_fields__
    return OffloadTierConfig(**{name: getattr(tier, name) for name in fields})


def positions(keys: list[bytes], access: RequestAccess) -> list[int]:
    return [UNKNOWN_POSITION if (p := access.position_of(k)) is None else p for k in keys]


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    with server_in_thread(dataclasses.replace(SMALL_POOL, kv_events=True, max_step_ops=64)) as s:
        yield s


def sample(server: ThreadedServer, name: str) -> float:
    metrics = server.server.metrics
    return metrics.registry.get_sample_value(f"kvservice_offload_{name}", metrics.labels) or 0.0


@contextlib.contextmanager
def session(server: ThreadedServer) -> Iterator[KVClient]:
    with KVClient(server.target) as client:
        lease = client.open_session(60)
        try:
            yield client
        finally:
            with contextlib.suppress(FailedPreconditionError):
                lease.close()


def step(
    client: KVClient, tier: pb.OffloadTierConfig, *ops: pb.OffloadOperation
) -> pb.OffloadStepResponse:
    return client.start_offload_step(pb.OffloadStepRequest(config=tier, ops=ops)).result()


def new_request(request_id: str, priority: int = 35) -> pb.OffloadOperation:
    return pb.OffloadOperation(
        new_request=pb.OffloadNewRequest(request_id=request_id, priority=priority)
    )


def store(request_id: str, keys: list[bytes], chunk_ids: list[int]) -> pb.OffloadOperation:
    return pb.OffloadOperation(
        prepare_store=pb.OffloadPrepareStore(
            request_id=request_id, keys=keys, keys_to_store=keys, chunk_ids=chunk_ids
        )
    )


# -- a replica driven as vLLM's offloading manager drives it ---------------------------


class Engine:
    """A replica index and its link, driven by random calls of vLLM's kinds."""

    def __init__(self, client: KVClient, tier: pb.OffloadTierConfig, rng: random.Random) -> None:
        self.rng = rng
        self.priorities = tier.eviction_policy == "priority"
        self.index = OffloadIndex(
            tier.num_chunks,
            tier.eviction_policy,
            store_threshold=tier.store_threshold,
            max_tracker_size=tier.max_tracker_size,
            enable_events=tier.enable_events,
            max_pinned_chunks=tier.max_pinned_chunks if self.priorities else None,
        )
        self.link = OffloadLink(client, client.open_session(60), settings(tier))
        self.requests: dict[str, RequestAccess] = {}
        self.storing: list[list[bytes]] = []
        self.loading: list[list[bytes]] = []
        self.now = 0.0
        self.serial = 0

    def access(self, request_id: str) -> RequestAccess:
        access = self.requests.get(request_id)
        if access is None or not self.index.is_current(access):
            priority = self.rng.choice((0, 35, 80)) if self.priorities else 35
            positions = {key(b, g): 16 * (b + 1) for b in range(40) for g in (0, 1)}
            access = self.index.request_access(positions.get, priority)
            self.link.new_request(request_id, priority)
            self.requests[request_id] = access
        return access

    def keys(self) -> list[bytes]:
        start = self.rng.randrange(0, 30)
        group = self.rng.choice((0, 0, 1))
        return [key(b, group) for b in range(start, start + self.rng.randint(1, 5))]

    def act(self) -> None:
        kind = self.rng.choice(
            (
                "store",
                "store",
                "store",
                "complete_store",
                "load",
                "complete_load",
                "touch",
                "finish",
                "new",
                "pin",
                "unpin",
                "expire",
                "reset",
            )
        )
        getattr(self, kind)()

    def new(self) -> None:
        self.serial += 1
        self.access(f"r{self.serial}")

    def _some_request(self) -> str:
        if not self.requests or self.rng.random() < 0.2:
            self.new()
        return self.rng.choice(sorted(self.requests))

    def store(self) -> None:
        request_id = self._some_request()
        keys, access = self.keys(), self.access(request_id)
        plan = self.index.prepare_store(keys, access)
        answer = None if plan is None else (plan.keys_to_store, plan.chunk_ids, plan.evicted_keys)
        self.link.prepare_store(request_id, keys, positions(keys, access), answer)
        if plan is not None and plan.keys_to_store:
            self.storing.append(plan.keys_to_store)

    def complete_store(self) -> None:
        if self.storing:
            keys, success = self.storing.pop(0), self.rng.random() < 0.85
            self.index.complete_store(keys, success)
            self.link.complete_store(keys, success)

    def load(self) -> None:
        ready = [k for k, (_, ref) in self.index.chunk_table().items() if ref >= 0]
        if ready:
            request_id = self._some_request()
            keys = self.rng.sample(ready, min(len(ready), 3))
            access = self.access(request_id)
            chunk_ids = self.index.prepare_load(keys, access)
            self.link.prepare_load(request_id, keys, positions(keys, access), chunk_ids)
            self.loading.append(keys)

    def complete_load(self) -> None:
        if self.loading:
            keys = self.loading.pop(0)
            self.index.complete_load(keys)
            self.link.complete_load(keys)

    def touch(self) -> None:
        keys = self.keys()
        self.index.touch(keys)
        self.link.touch(keys)

    def finish(self) -> None:
        if self.requests:
            request_id = self.rng.choice(sorted(self.requests))
            keys = self.index.request_finished(self.requests.pop(request_id))
            self.link.request_finished(request_id, keys)

    def pin(self) -> None:
        if not self.priorities:
            return
        pin_id, keys, ttl = (
            f"p{self.rng.randrange(4)}",
            self.keys(),
            self.rng.choice((None, 1.0, 5.0)),
        )
        try:
            self.index.pin(pin_id, keys, ttl, self.now)
            refused = False
        except QuotaExceededError:
            refused = True
        self.link.pin(pin_id, keys, ttl, self.now, refused)

    def unpin(self) -> None:
        if self.priorities:
            pin_id = f"p{self.rng.randrange(4)}"
            self.link.unpin(pin_id, self.index.unpin(pin_id))

    def expire(self) -> None:
        self.now += self.rng.choice((0.5, 2.0))
        if self.priorities:
            self.link.expire_pins(self.now, self.index.expire_pins(self.now))

    def reset(self) -> None:
        if self.rng.random() < 0.3 and not self.loading and not self.storing:
            self.index.reset()
            self.link.reset()


@fuzz_settings(15)
@given(
    policy=st.sampled_from(("lru", "arc", "priority")),
    threshold=st.sampled_from((0, 2)),
    seed=st.integers(0, 2**16),
)
def test_the_server_agrees_with_a_replica_call_for_call(
    server: ThreadedServer, policy: str, threshold: int, seed: int
) -> None:
    """Random calls of every kind (stores that evict, failed stores, loads, pins past
    the quota, expiries, resets) on a replica, sent once a step: the server's index
    answers each one alike, and the session's end drops it."""
    rng = random.Random(seed)
    with KVClient(server.target) as client:
        engine = Engine(client, config(policy, store_threshold=threshold), rng)
        for _ in range(12):
            for _ in range(rng.randint(0, 8)):
                engine.act()
            engine.link.flush()
            engine.link.confirm()
            if not engine.link.round_trips:
                continue  # nothing sent yet: the server has built no index
            assert server.call(lambda: index_state(server_index(server, engine))) == index_state(
                engine.index
            )
        engine.link.close()
    assert sample(server, "tiers") == 0


def server_index(server: ThreadedServer, engine: Engine) -> OffloadIndex:
    return server.server.offload_tiers._tiers[engine.link.session_id].index


def index_state(index: OffloadIndex) -> tuple[object, ...]:
    """Everything an index decides by: its chunks, free list and pins."""
    pins = index.pin_counters if index.policy_name == "priority" else None
    return (index.chunk_table(), index.free_chunk_ids(), index.num_allocated_chunks, pins)


# -- refusals -------------------------------------------------------------------------


def test_without_a_session_it_is_refused(server: ThreadedServer) -> None:
    with (
        KVClient(server.target) as client,
        pytest.raises(FailedPreconditionError, match="OpenSession"),
    ):
        step(client, config(), new_request("a"))


@pytest.mark.parametrize(
    ("tier", "op", "message"),
    [
        (config(num_chunks=0), new_request("a"), "num_chunks must be in"),
        (config("fifo"), new_request("a"), "eviction_policy 'fifo'"),
        (config("lru", max_pinned_chunks=3), new_request("a"), "priority' policy only"),
        (config(), new_request(""), "request_id must be 1-256"),
        (config(), new_request("a", priority=101), "priority"),
        (config(), store("a", [b"abcd"], [0]), "offload key is a block hash"),
        (
            config(),
            pb.OffloadOperation(
                prepare_load=pb.OffloadPrepareLoad(request_id="a", keys=[key(1)], positions=[1, 2])
            ),
            "2 positions for 1 keys",
        ),
        (
            config("priority"),
            pb.OffloadOperation(
                pin=pb.OffloadPin(pin_id="p", keys=[key(1)], ttl_seconds=float("nan"))
            ),
            "ttl_seconds must be finite",
        ),
        (config(), pb.OffloadOperation(), "sets no operation"),
    ],
)
def test_a_malformed_step_is_refused_and_builds_nothing(
    server: ThreadedServer, tier: pb.OffloadTierConfig, op: pb.OffloadOperation, message: str
) -> None:
    """INVALID_ARGUMENT naming the field, before anything runs: no index is built,
    and the session's next (good) step builds one from scratch."""
    with session(server) as client:
        with pytest.raises(InvalidArgumentError, match=message):
            step(client, tier, new_request("first"), op)
        assert sample(server, "tiers") == 0
        # "first" was not announced: announcing it now is no divergence.
        assert step(client, config(), new_request("first")).num_ops == 1
        assert sample(server, "tiers") == 1
    assert sample(server, "tiers") == 0


def test_too_many_operations_are_refused(server: ThreadedServer) -> None:
    with session(server) as client, pytest.raises(InvalidArgumentError, match="at most 64"):
        step(client, config(), *(new_request(f"r{i}") for i in range(65)))


def test_an_answer_the_server_gives_otherwise_stops_the_index(server: ThreadedServer) -> None:
    """The replica claims other chunk ids: FAILED_PRECONDITION naming the operation and
    both answers, after the operations before it ran; every later step is refused, and
    another config is refused too."""
    with session(server) as client:
        step(client, config(), new_request("a"), store("a", [key(1), key(2)], [0, 1]))
        with pytest.raises(FailedPreconditionError) as refused:
            step(client, config(), new_request("b"), store("b", [key(3)], [7]))
        assert "ops[1] (prepare_store)" in refused.value.message
        assert "chunk ids [2]; the replica [7]" in refused.value.message
        with pytest.raises(FailedPreconditionError, match=r"stopped at ops\[1\] \(prepare_store\)"):
            step(client, config(), new_request("c"))


def test_a_config_other_than_the_indexs_is_refused(server: ThreadedServer) -> None:
    with session(server) as client:
        step(client, config(), new_request("a"))
        with pytest.raises(FailedPreconditionError, match="config differs"):
            step(client, config("arc"), new_request("b"))
        # Nothing ran, and the index goes on.
        step(client, config(), new_request("b"), store("b", [key(1)], [0]))


def test_a_link_stops_at_the_first_failure(server: ThreadedServer) -> None:
    """The link raises at the check after a refused step, and refuses every call after."""
    with KVClient(server.target) as client:
        link = OffloadLink(client, client.open_session(60), settings(config()))
        link.new_request("a", 35)
        link.new_request("a", 35)  # announced twice: the server refuses
        link.flush()
        with pytest.raises(OffloadLinkError, match="announced already"):
            link.confirm()
        with pytest.raises(OffloadLinkError, match="earlier failure"):
            link.touch([key(1)])
        link.close()


def test_the_tier_counts_and_publishes_its_chunks(server: ThreadedServer) -> None:
    """Stores, failed stores, loads and evictions are counted (bytes from the config's
    chunk size), and the stored and removed chunks are KV events with medium CPU, one
    per KV cache group, hashes without the group suffix."""
    before = {
        name: sample(server, name)
        for name in (
            "keys_stored_total",
            "bytes_stored_total",
            "keys_loaded_total",
            "store_failures_total",
        )
    }
    published: list[KVCacheEvent] = []
    events = server.server.events
    assert events is not None
    server.call(lambda: events.add_listener(published.extend))
    with session(server) as client:
        keys = [key(1), key(2), key(3, group=1)]
        step(
            client,
            config(),
            new_request("a"),
            store("a", keys, [0, 1, 2]),
            pb.OffloadOperation(
                complete_store=pb.OffloadCompleteStore(keys=keys[:2], success=True)
            ),
            pb.OffloadOperation(
                complete_store=pb.OffloadCompleteStore(keys=keys[2:], success=False)
            ),
            pb.OffloadOperation(
                prepare_load=pb.OffloadPrepareLoad(request_id="a", keys=[key(1)], chunk_ids=[0])
            ),
        )
        assert sample(server, "chunks_used") == 2
    assert published == [
        BlockStored([key(1)[:32], key(2)[:32]], None, [], 0, None, "CPU", group_idx=0),
        BlockRemoved([key(3)[:32]], "CPU", group_idx=1),
    ]
    assert sample(server, "keys_stored_total") - before["keys_stored_total"] == 2
    assert sample(server, "bytes_stored_total") - before["bytes_stored_total"] == 2 * 4096
    assert sample(server, "store_failures_total") - before["store_failures_total"] == 1
    assert sample(server, "keys_loaded_total") - before["keys_loaded_total"] == 1
    assert sample(server, "chunks_used") == 0
