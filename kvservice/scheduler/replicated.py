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
from kvservice.client.step import StepBuilder
from kvservice.client.step_link import RemoteStepError, Send, SentStep, StepLink
from kvservice.client.step_log import ANY_ANSWER
from kvservice.client.types import REPLICA_RETENTION_REFUSAL
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
        return group_spec(shape, attention, group.page_size_bytes, enable_caching)
    except InvalidArgumentError:
        raise RemoteStepError(
            f"the server's KV cache group {group.kind!r} (block size {group.block_size}) "
            "cannot be replicated from its GetCacheConfig: use the unary RemoteBackend"
        ) from None


def replica_manager(config: CacheConfig, target: str = "the server") -> KVCacheManager:
    """A fresh pool laid out as the server's, deciding as the server's does.
    ``RemoteStepError`` for a pool with retention (priorities or pins): its server
    decides by a clock and pins the replica does not see."""
    if config.has_retention:
        raise RemoteStepError(
            f"kvservice at {target} runs eviction policy {config.eviction_policy!r} with a "
            f"pinned budget of {config.max_pinned_blocks} blocks: {REPLICA_RETENTION_REFUSAL}"
        )
    groups = [
        KVCacheGroupSpec(list(group.layer_names), _group_spec(group, config.enable_caching))
        for group in config.groups
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
        max_in_flight_tokens=config.max_in_flight_tokens or None,
        # The replica's hashes never leave this process: only which blocks match
        # matters, so the fastest hash serves (a collision would show as an answer
        # that differs at the check, never silently).
        hash_algo="xxhash",
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
        # Checked before the pool is claimed (reset): a refused backend changes nothing.
        manager = replica_manager(client.get_cache_config(), client.target)
        _claim_pool(client)
        super().__init__(manager)
        self.link = StepLink(send, client.target, overlap=overlap, ordered=ordered)

    @property
    def round_trips(self) -> int:
        """Messages sent: one per step that changed anything."""
        return self.link.round_trips

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.link.check_alive()
        super().add_request(request_id, prompt_token_ids)
        # A copy: the step leaves after the scheduler appended the step's output to
        # its token list.
        self.link.log.add_request(request_id, list(prompt_token_ids))

    def new_step_starts(self) -> None:
        self.link.check_alive()
        super().new_step_starts()
        self.link.log.record("new_step_starts", (), ANY_ANSWER)

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        self.link.check_alive()
        hit = super().get_computed_blocks(request_id)
        self.link.log.record("get_computed_blocks", (request_id,), hit)
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
        if hit is None and options is None:
            self.link.log.allocate(request_id, num_new_tokens, ids, copies)
        else:
            args = (request_id, num_new_tokens, hit, options)
            self.link.log.record("allocate_slots", args, ids, copies)
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
        self.link.log.record("free", (request_id, mode), ANY_ANSWER)

    def end_step(self) -> None:
        """The step's decisions are made: send them (one message)."""
        self.link.flush()

    def flush(self) -> None:
        """Send what is recorded and check every step sent."""
        self.link.flush()
        self.link.confirm()


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
        self._stream: Session = client.session()
        stream = self._stream

        def send(step: StepBuilder) -> SentStep:
            return stream.send(step, stop_on_error=True)

        super().__init__(client, send, overlap=overlap)

    def close(self) -> None:
        """Send and check what is left, then end the stream (after a failure, drop
        it: nothing more is sent)."""
        if self.link.failed:
            self._stream.cancel()
            return
        self.flush()
        self._stream.close()

    def __enter__(self) -> StreamBackend:
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
            self._stream.cancel()
