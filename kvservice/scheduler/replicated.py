"""The reference scheduler's remote backends: a replica request table in this process
answers every call at once, and each scheduling step goes to the server as one
message whose answers must equal the replica's (``kvservice.client.step_link``, the
mechanism vLLM's scheduler reaches the server by too).

The replica is a fresh pool laid out as the server's (its ``GetCacheConfig``), behind
the request table the server runs, so it decides as the server would: the scheduler
never waits for an answer in the middle of a step, and a step costs one message
(``end_step``), sent after the step's decisions. The appends and frees that follow
the forward pass ride with the next step's message. The server decides all the same:
an answer that differs from the replica's, or an operation it refuses, raises
``RemoteStepError`` at the check, and the backend refuses every call after that.

Since the replica starts from a fresh pool, the server's pool must be this
scheduler's alone: the backend refuses a pool that holds blocks, and resets it to a
fresh pool's state (as the vLLM integration does).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Self

from kvservice.client import (
    AdmitOptions,
    AdmitResult,
    BlockIds,
    CacheConfig,
    ComputedBlocks,
    FreeMode,
    KVCacheGroup,
    KVClient,
    Session,
)
from kvservice.client.errors import RemoteStepError
from kvservice.client.step import StepBuilder
from kvservice.client.step_link import Send, SentStep, StepLink
from kvservice.client.step_log import ANY_ANSWER
from kvservice.client.types import Retention, RetentionChange
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_groups import GroupShape, group_spec
from kvservice.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecKind,
)
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.replication import core_retention_event
from kvservice.scheduler.backend import (
    AdmittedIds,
    InProcessBackend,
    client_options,
)


def _group_spec(group: KVCacheGroup, enable_caching: bool) -> KVCacheSpec:
    """The core's spec of one group the server reported, as the server lays it out."""
    shape = GroupShape.reported(
        group.kind, group.block_size, group.sliding_window, group.attention_chunk_size
    )
    try:
        attention = (
            None
            if shape.kind is KVCacheSpecKind.MAMBA
            else FullAttentionSpec(
                group.block_size, group.num_kv_heads, group.head_size, group.dtype
            )
        )
        return group_spec(
            shape,
            attention,
            group.page_size_bytes,
            enable_caching,
            group.max_num_encoder_input_tokens or 0,
        )
    except InvalidArgumentError:
        raise RemoteStepError(
            f"the server's KV cache group {group.kind!r} (block size {group.block_size}) "
            "cannot be replicated from its GetCacheConfig: use the unary RemoteBackend"
        ) from None


def replica_manager(config: CacheConfig, target: str = "the server") -> KVCacheManager:
    """A fresh pool laid out as the server's, deciding as the server's does (its
    retention policy and pinned budget too: the server's changes reach it through a
    replica session)."""
    # The replica's hashes never leave this process: only which blocks match matters,
    # so the fastest hash serves (a collision would show as an answer that differs at
    # the check, never silently). But pins arrive as the server's cache keys: with a
    # pinned budget the replica must hash exactly as the server does.
    hash_algo, none_hash_seed = "xxhash", None
    if config.max_pinned_blocks > 0:
        if not config.none_hash_seed:
            raise RemoteStepError(
                f"kvservice at {target} pins prefixes by its cache keys, but its hash seed "
                f"is secret ({config.hash_algo}, a random seed): the replica cannot hash as "
                f"it does. Start it with --none-hash-seed, or a SHA hash algorithm"
            )
        hash_algo, none_hash_seed = config.hash_algo, config.none_hash_seed
    eagle = set(config.eagle_group_ids) if len(config.eagle_group_ids) < len(config.groups) else ()
    groups = [
        KVCacheGroupSpec(
            list(group.layer_names),
            _group_spec(group, config.enable_caching),
            is_eagle_group=i in eagle,
        )
        for i, group in enumerate(config.groups)
    ]
    manager = KVCacheManager(
        KVCacheConfig(
            config.num_blocks,
            [],
            groups,
            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        ),
        config.max_model_len,
        scheduler_block_size=config.scheduler_block_size,
        hash_block_size=config.hash_block_size,
        enable_caching=config.enable_caching,
        use_eagle=config.use_eagle,
        num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
        max_in_flight_tokens=config.max_in_flight_tokens or None,
        hash_algo=hash_algo,
        none_hash_seed=none_hash_seed,
        eviction_policy=config.eviction_policy,
        max_pinned_blocks=config.max_pinned_blocks,
    )
    # The server reports its watermark in blocks, the count the manager decides with.
    manager.watermark_blocks = config.watermark_blocks
    return manager


def _admitted_view(result: AdmitResult) -> list[tuple[str, int, int, BlockIds]]:
    return [
        (a.request_id, a.hit.num_computed_tokens, a.num_new_tokens, a.allocation.new_block_ids)
        for a in result.admitted
    ]


def _admitted_answer(admitted: Sequence[AdmittedIds]) -> list[tuple[str, int, int, BlockIds]]:
    return [(a.request_id, a.num_hit_tokens, a.num_new_tokens, a.new_block_ids) for a in admitted]


class ReplicatedBackend(InProcessBackend):
    """A ``Backend`` over a kvservice server: the replica (this in-process backend)
    answers, ``send`` carries each step to the server (see the module docstring);
    ``overlap`` checks a step's answers while the next is planned."""

    def __init__(
        self, client: KVClient, send: Send, *, overlap: bool = False, ordered: bool = True
    ) -> None:
        config = client.get_cache_config()
        manager = replica_manager(config, client.target)
        # On a pool with retention the server decides pins and expiries at this
        # backend's steps, through a replica session (``close`` ends it).
        self._lease = client.open_session(replica=True) if config.has_retention else None
        _claim_pool(client)
        super().__init__(manager)
        self.table.follow_server()
        self.link = StepLink(
            send,
            client.target,
            overlap=overlap,
            ordered=ordered,
            apply_retention=self._apply_retention,
        )

    def _apply_retention(self, changes: list[RetentionChange]) -> None:
        for change in changes:
            self.table.apply_retention_event(core_retention_event(change))

    @property
    def round_trips(self) -> int:
        """Messages sent: one per step that changed anything."""
        return self.link.round_trips

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        retention: Retention | None = None,
    ) -> None:
        self.link.check_alive()
        super().add_request(request_id, prompt_token_ids, retention)
        # A copy: the step leaves after the scheduler appended the step's output to
        # its token list.
        if retention is None:
            self.link.log.add_request(request_id, list(prompt_token_ids))
        else:
            self.link.log.add_request(request_id, list(prompt_token_ids), retention=retention)

    def new_step_starts(self) -> None:
        self.link.check_alive()
        super().new_step_starts()
        self.link.log.record("new_step_starts", (), ANY_ANSWER)

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        self.link.check_alive()
        hit = super().get_computed_blocks(request_id)
        self.link.log.lookup(request_id, hit)
        return hit

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        self.link.check_alive()
        allocation = self._allocate(
            request_id, num_new_tokens, hit, num_lookahead_tokens, full_sequence_must_fit
        )
        ids = self._new_ids(allocation)
        copies = tuple(allocation.block_copies_to_apply)
        options = client_options(num_lookahead_tokens, full_sequence_must_fit)
        self.link.log.allocate(request_id, num_new_tokens, ids, copies, hit, options)
        return ids

    def admit(
        self, request_ids: Sequence[str], token_budget: int, options: AdmitOptions
    ) -> list[AdmittedIds]:
        self.link.check_alive()
        admitted = super().admit(request_ids, token_budget, options)
        args = (request_ids, token_budget, options)
        self.link.log.record("admit", args, _admitted_answer(admitted), view=_admitted_view)
        return admitted

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.link.check_alive()
        super().append_tokens(request_id, token_ids)
        self.link.log.append_tokens(request_id, token_ids)

    def free(self, request_id: str, preempt: bool = False) -> None:
        self.link.check_alive()
        super().free(request_id, preempt)
        mode = FreeMode.PREEMPT if preempt else FreeMode.FINISH
        self.link.log.free(request_id, mode)

    def end_step(self) -> None:
        """The step's decisions are made: send them (one message)."""
        self.link.flush()

    def flush(self) -> None:
        """Send what is recorded and check every step sent."""
        self.link.flush()
        self.link.confirm()

    def close(self) -> None:
        """Send and check what is left (after a failure, nothing more is sent), end
        the transport, then the replica session, if any (what the server held for it
        takes effect)."""
        if self.link.failed:
            self._drop()
        else:
            self.flush()
            self._finish()
        self._end_session()

    def _finish(self) -> None:
        """End the transport once everything is sent (unary calls: nothing to end)."""

    def _drop(self) -> None:
        """Drop the transport, sending nothing more."""

    def _end_session(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self._drop()
            self._end_session()


def _claim_pool(client: KVClient) -> None:
    """Refuse a pool in use; reset an idle one to a fresh pool's state, the state the
    replica starts from."""
    usage = client.get_usage(pool_wide=True)
    if usage.num_requests or usage.num_used_blocks:
        raise RemoteStepError(
            f"kvservice at {client.target} holds {usage.num_used_blocks} blocks for "
            f"{usage.num_requests} requests: a replicated backend needs a pool of its own "
            "(an idle server; use the unary RemoteBackend to share one)"
        )
    if not client.reset_prefix_cache(fresh_pool=True):
        raise RemoteStepError(f"kvservice at {client.target} refused to reset its pool")


class StepBackend(ReplicatedBackend):
    """A ``ReplicatedBackend`` over unary ``Step`` RPCs; ``overlap``: the server runs a
    step while the scheduler plans the next, and its answers are checked before the
    next is sent (``Step`` calls in flight together are not ordered)."""

    def __init__(self, client: KVClient, *, overlap: bool = False) -> None:
        def send(step: StepBuilder) -> SentStep:
            return client.start_step(step, stop_on_error=True)

        super().__init__(client, send, overlap=overlap, ordered=False)


class StreamBackend(ReplicatedBackend):
    """A ``ReplicatedBackend`` over one ``StepStream`` session; ``close`` (or ``with``)
    ends it. ``overlap``: the server runs a step while the scheduler plans the next,
    and its answers are checked at the next send."""

    def __init__(self, client: KVClient, *, overlap: bool = False) -> None:
        self._client = client
        # Opened by the first step, after the backend's session (its metadata is the
        # stream's for good).
        self._stream: Session | None = None
        super().__init__(client, self._send, overlap=overlap)

    def _send(self, step: StepBuilder) -> SentStep:
        if self._stream is None:
            self._stream = self._client.session()
        return self._stream.send(step, stop_on_error=True)

    def _finish(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
