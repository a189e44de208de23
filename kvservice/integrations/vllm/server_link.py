"""The remote half of ``KVServiceKVCacheManager``: a kvservice server that confirms
every decision of the scheduler's replica, one round trip per scheduler step.

The scheduler's process keeps a replica (the manager's core, started from the same
fresh pool) that answers vLLM's scheduler at once; ``ServerLink`` translates each
call that changed the pool into the server's operations and records them with the
replica's answers on the one remote-step mechanism (``kvservice.client.step_link``).
When the scheduler closes the step (its ``take_kv_cache_block_copies`` call, the last
one before the ``SchedulerOutput`` leaves ``schedule()``), the step goes to the
server on one ``StepStream`` and every answer is compared with the replica's; a
refusal or a difference raises ``KVServiceManagerError`` before the scheduler's output
is used. The frees and appends that follow the forward pass travel with the next step.
Every step keeps its copy holds (``keep_copy_holds``) until the replica's scheduler
releases them, as vLLM's does.

What is vLLM's here: what each vLLM request has on the server (its tokens, its
computed tokens as the server counts them, its last lookup, the hash blocks cached),
so a call sends only what the server lacks.

The replica starts from a fresh pool, so the server's pool must be this engine's
alone: at startup the link waits for the pool to hold no blocks (a previous engine's
lease running out), then resets it to a fresh pool's state (the KV its cache entries
described lived in the previous engine's memory).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvservice.client import (
    BlockIds,
    CacheConfig,
    ComputedBlocks,
    KVCacheGroup,
    KVClient,
    KVServiceError,
    Lease,
    MultiModalFeature,
    StepSession,
)
from kvservice.client.errors import RemoteStepError
from kvservice.client.step_link import StepLink
from kvservice.client.step_log import ANY_ANSWER
from kvservice.client.types import Retention, RetentionChange
from kvservice.core.allocation_options import AllocationOptions
from kvservice.core.kv_cache_groups import GroupShape
from kvservice.core.kv_cache_interface import KVCacheSpecKind
from kvservice.core.retention_policy import RetentionConfig, RetentionEvent
from kvservice.integrations.vllm.embeds import prompt_embeds_bytes
from kvservice.integrations.vllm.settings import ConnectionSettings
from kvservice.replication import ServerRequests, client_retention, core_retention_event

logger = logging.getLogger(__name__)

# How often startup polls a pool that a previous engine's lease still holds.
_IDLE_POLL_S = 0.5

# Group kinds that never release a block while its request runs.
_KEEP_EVERY_BLOCK = frozenset(
    {KVCacheSpecKind.FULL_ATTENTION.value, KVCacheSpecKind.CROSS_ATTENTION.value}
)


class KVServiceManagerError(RemoteStepError):
    """The kvservice server could not be reached, refused a step, or answered otherwise
    than the scheduler's replica: the manager stops, since the two no longer agree."""


class ServerConfigMismatchError(KVServiceManagerError):
    """The server's pool is not the one vLLM computed; the message names both."""


def seed_fingerprint(seed: str) -> str:
    """``GetCacheConfigResponse.none_hash_seed_fingerprint`` of ``seed``: the first 16
    hex digits of its SHA-256, so the seed itself never crosses the wire."""
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """The pool vLLM computed, as the server must have it."""

    groups: list[tuple[str, int]]  # (kind, block size in scheduler tokens)
    # The groups as ``kvservice serve --kv-cache-groups`` writes them (kinds, windows,
    # chunks, Mamba block sizes: ``kvservice.core.kv_cache_groups``).
    kv_cache_groups: str
    # vLLM's prefix_cache_retention_interval (what the window and Mamba groups cache).
    prefix_cache_retention_interval: int | None
    num_blocks: int
    watermark: float
    watermark_blocks: int
    enable_caching: bool
    max_model_len: int
    hash_block_size: int
    # vLLM's max_in_flight_tokens, and the admission cap (blocks) it gives each
    # window-bounded group (None for the others).
    max_in_flight_tokens: int
    admission_caps: tuple[int | None, ...]
    # The groups an EAGLE drafter reads (vLLM's use_eagle; empty without a drafter).
    eagle_group_ids: frozenset[int] = frozenset()
    # Tokens after each block its hash covers (vLLM's num_hash_lookahead_tokens).
    num_hash_lookahead_tokens: int = 0

    def admission_blocks(self, caps: Sequence[int | None]) -> list[int]:
        """The most blocks admission can count per group for a request of vLLM's:
        ``caps`` bounded by the blocks of ``max_model_len`` tokens (a cap above that
        decides as no cap)."""
        return [
            longest if cap is None else min(cap, longest)
            for cap, longest in zip(
                caps,
                [-(-self.max_model_len // block_size) for _, block_size in self.groups],
                strict=True,
            )
        ]


def _group_words(groups: Sequence[KVCacheGroup]) -> str:
    """The server's groups (``GetCacheConfig``) as ``--kv-cache-groups`` writes them."""
    return ",".join(
        str(GroupShape.reported(g.kind, g.block_size, g.sliding_window, g.attention_chunk_size))
        for g in groups
    )


class ServerLink:
    """A session on a kvservice server that replays and checks the replica's
    operations (see the module docstring)."""

    def __init__(self, settings: ConnectionSettings) -> None:
        """Connect and read the server's cache config; ``start`` checks it and opens
        the engine's session."""
        assert settings.target is not None, "a ServerLink needs KVSERVICE_TARGET"
        self.target = settings.target
        self.settings = settings
        self._client: KVClient = self._call("connect", settings.connect)
        self.server_config: CacheConfig = self._call(
            "GetCacheConfig", self._client.get_cache_config
        )
        # Each step on the engine's stream (opened by start).
        self._link = StepLink(
            lambda step: self._session.send(step, stop_on_error=True),
            self.target,
            overlap=settings.confirm == "overlap",
            keep_copy_holds=True,
            error=KVServiceManagerError,
            apply_retention=self._apply_retention,
        )
        # Where the server's retention changes go (the replica's manager; set by it).
        self.retention_sink: Callable[[list[RetentionEvent]], None] | None = None
        # What each new request asks of retention, sent with its AddRequest.
        self._retention: dict[str, tuple[Retention | None, float | None]] = {}
        # What the server has of each request (its tokens, computed tokens, hashes),
        # recording on the step only what it lacks. vLLM's block hashes go with the
        # tokens when the server trusts them (it then hashes nothing).
        self._requests = ServerRequests(
            self._link,
            sends_hashes=settings.client_block_hashes
            and self.server_config.trusts_client_block_hashes,
            hash_block_size=self.server_config.hash_block_size,
            num_hash_lookahead_tokens=self.server_config.num_hash_lookahead_tokens,
        )
        # The last lookup of each waiting request: what its allocation attaches.
        self._lookups: dict[str, ComputedBlocks] = {}
        # An allocation that attaches no hit, recorded from the replica's request
        # (``ServerRequests.record_allocation``; False: the server lacks the request,
        # record it with ``allocated``): the manager calls it for every decode step's.
        self.record_allocation = self._requests.record_allocation

    @property
    def round_trips(self) -> int:
        return self._link.round_trips

    def pool_size(self, vllm_num_blocks: int) -> int:
        """The blocks the scheduler may use: the server's pool when it is no larger than
        the one vLLM computed (vLLM's KV cache tensors then hold every block id the
        server hands out), else vLLM's, which ``start`` refuses."""
        server_num_blocks = self.server_config.num_blocks
        if server_num_blocks >= vllm_num_blocks:
            return vllm_num_blocks
        logger.warning(
            "kvservice at %s has %d KV cache blocks, vLLM computed %d: the scheduler "
            "uses kvservice's %d (the rest of vLLM's KV cache stays unused; start "
            "kvservice with --num-blocks %d to use it all)",
            self.target,
            server_num_blocks,
            vllm_num_blocks,
            server_num_blocks,
            vllm_num_blocks,
        )
        return server_num_blocks

    def start(self, layout: PoolLayout) -> None:
        """Check that the server's pool is ``layout``, open the engine's session, wait
        for the pool to be idle and reset it to a fresh pool's state."""
        settings = self.settings
        self._check_layout(layout)
        # Groups that release blocks out of view (sliding windows, chunked local
        # attention, Mamba states), below the processed tokens only.
        self._requests.windowed = any(kind not in _KEEP_EVERY_BLOCK for kind, _ in layout.groups)
        # A restarted engine opens with a higher epoch, which fences its predecessor.
        self._lease: Lease = self._call(
            "OpenSession",
            lambda: self._client.open_session(
                settings.session_ttl_s,
                epoch=time.time_ns() // 1000,
                client_name=settings.client_id,
                # On a pool with retention the server sequences its decisions (pins,
                # expiries) at this session's steps, for the replica to follow.
                replica=self.server_config.has_retention,
            ),
        )
        self._wait_for_idle_pool()
        if not self._call(
            "ResetPrefixCache", lambda: self._client.reset_prefix_cache(fresh_pool=True)
        ):
            raise KVServiceManagerError(f"kvservice at {self.target} refused to reset its pool")
        self._session: StepSession = self._call("StepStream", self._open_steps)

    def _open_steps(self) -> StepSession:
        """The engine's StepStream: on the server's step socket when one is set (with
        ``overlap``, written by a thread of its own while the scheduler goes on)."""
        path = self.settings.step_socket
        if not path:
            return self._client.session()
        return self._client.socket_session(path, write_thread=self.settings.confirm == "overlap")

    def _apply_retention(self, changes: list[RetentionChange]) -> None:
        """The server's retention decisions, due now, to the replica (in the core's
        terms: the one place the client's are translated)."""
        if self.retention_sink is not None:
            self.retention_sink([core_retention_event(change) for change in changes])

    # -- startup --------------------------------------------------------------------

    def _call(self, name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except KVServiceError as error:
            raise KVServiceManagerError(
                f"kvservice at {self.target}: {name} failed: {error}"
            ) from error

    def _check_layout(self, layout: PoolLayout) -> None:
        """The server's pool must be the one vLLM computed: same groups, block sizes,
        windows, pool size and policy (hashing is checked by ``check_hashing``, which
        knows vLLM's algorithm)."""
        server = self.server_config
        server_groups = [(group.kind, group.block_size) for group in server.groups]
        # (what, vLLM's value, kvservice's value, how to fix it)
        comparisons = [
            (
                "KV cache groups",
                layout.kv_cache_groups,
                _group_words(server.groups),
                f" (start kvservice with --kv-cache-groups {layout.kv_cache_groups})",
            ),
            (
                "block sizes",
                [size for _, size in layout.groups],
                [size for _, size in server_groups],
                f" (start kvservice with --block-size {layout.groups[0][1]})",
            ),
            (
                "num_blocks",
                layout.num_blocks,
                server.num_blocks,
                f" (kvservice's pool may not be larger than vLLM's KV cache: start "
                f"kvservice with --num-blocks {layout.num_blocks} or fewer)",
            ),
            (
                "watermark blocks",
                layout.watermark_blocks,
                server.watermark_blocks,
                f" (start kvservice with --watermark {layout.watermark})",
            ),
            (
                "prefix caching",
                layout.enable_caching,
                server.enable_caching,
                " (kvservice --enable-caching / --no-enable-caching)",
            ),
            (
                "hash block size",
                layout.hash_block_size,
                server.hash_block_size,
                f" (start kvservice with --hash-block-size {layout.hash_block_size})",
            ),
            (
                "lookahead tokens each block hash covers (an EAGLE drafter's lookahead hashes)",
                layout.num_hash_lookahead_tokens,
                server.num_hash_lookahead_tokens,
                " (start kvservice with --num-hash-lookahead-tokens "
                f"{layout.num_hash_lookahead_tokens})",
            ),
        ]
        mismatches = [
            f"{what}: vLLM {ours}, kvservice {theirs}{hint}"
            for what, ours, theirs, hint in comparisons
            if ours != theirs
        ]
        server_caps = [group.max_admission_blocks_per_request for group in server.groups]
        if layout.groups == server_groups and layout.admission_blocks(
            layout.admission_caps
        ) != layout.admission_blocks(server_caps):
            mismatches.append(
                f"admission blocks per request of the window-bounded groups (from "
                f"max_in_flight_tokens): vLLM {list(layout.admission_caps)} from "
                f"{layout.max_in_flight_tokens}, kvservice {server_caps} from "
                f"{server.max_in_flight_tokens} (start kvservice with --max-in-flight-tokens "
                f"{layout.max_in_flight_tokens})"
            )
        mismatches.extend(self._eagle_mismatch(layout))
        sparse = {KVCacheSpecKind.SLIDING_WINDOW.value, KVCacheSpecKind.MAMBA.value}
        retention = layout.prefix_cache_retention_interval
        if retention != server.prefix_cache_retention_interval and any(
            kind in sparse for kind, _ in layout.groups
        ):
            fix = (
                f"start kvservice with --prefix-cache-retention-interval {retention}"
                if retention is not None
                else "start kvservice without --prefix-cache-retention-interval"
            )
            mismatches.append(
                f"prefix cache retention interval (which blocks of the sliding-window and "
                f"Mamba groups are cached): vLLM {retention}, kvservice "
                f"{server.prefix_cache_retention_interval} ({fix})"
            )
        if server.max_model_len < layout.max_model_len:
            mismatches.append(
                f"max_model_len: vLLM {layout.max_model_len}, kvservice "
                f"{server.max_model_len} (kvservice refuses longer sequences: start it with "
                f"--max-model-len {layout.max_model_len}, or give vLLM --max-model-len "
                f"{server.max_model_len})"
            )
        if mismatches:
            raise ServerConfigMismatchError(
                f"kvservice at {self.target} does not match vLLM's KV cache: "
                + "; ".join(mismatches)
            )

    def _eagle_mismatch(self, layout: PoolLayout) -> list[str]:
        """An EAGLE drafter's hits drop their last block in the same groups on the
        server (``--use-eagle``, ``--eagle-groups``), or on neither side."""
        server = self.server_config
        server_eagle = frozenset(server.eagle_group_ids)
        if not server_eagle and server.use_eagle:  # a server that predates the field
            server_eagle = frozenset(range(len(layout.groups)))
        ours = layout.eagle_group_ids
        if ours == server_eagle:
            return []
        if not ours:
            return ["EAGLE drafting: vLLM off, kvservice on (start kvservice without --use-eagle)"]
        every_group = frozenset(range(len(layout.groups)))
        fix = "--use-eagle" + (
            "" if ours == every_group else " --eagle-groups " + ",".join(map(str, sorted(ours)))
        )
        if not server_eagle:
            return [f"EAGLE drafting: vLLM on, kvservice off (start kvservice with {fix})"]
        return [
            f"EAGLE drafter groups: vLLM {sorted(ours)}, kvservice {sorted(server_eagle)} "
            f"(start kvservice with {fix})"
        ]

    def check_hashing(self, hash_algo: str, none_hash_seed: str | None) -> None:
        """Refuse a server that hashes blocks otherwise than vLLM: its KV events and
        its prefix cache would name different blocks than vLLM's."""
        server = self.server_config
        mismatches = []
        if server.hash_algo != hash_algo:
            mismatches.append(f"hash algorithm: vLLM {hash_algo}, kvservice {server.hash_algo}")
        if none_hash_seed is not None:
            fix = (
                "set the same PYTHONHASHSEED for vLLM and kvservice, or start kvservice "
                "with --none-hash-seed set to vLLM's seed"
            )
            if server.none_hash_seed_source == "random":
                mismatches.append(
                    f"hash seed: kvservice draws a random seed ({server.hash_algo} without "
                    f"--none-hash-seed or PYTHONHASHSEED), vLLM's cannot match it ({fix})"
                )
            elif server.none_hash_seed:
                # The server reports a seed that is not secret: compare the seeds.
                if server.none_hash_seed != none_hash_seed:
                    mismatches.append(
                        f"hash seed: vLLM {none_hash_seed!r}, kvservice "
                        f"{server.none_hash_seed!r} (from {server.none_hash_seed_source}; "
                        f"{fix})"
                    )
            elif seed_fingerprint(none_hash_seed) != server.none_hash_seed_fingerprint:
                mismatches.append(
                    f"hash seed fingerprint: vLLM {seed_fingerprint(none_hash_seed)}, "
                    f"kvservice {server.none_hash_seed_fingerprint} ({fix})"
                )
        if mismatches:
            raise ServerConfigMismatchError(
                f"kvservice at {self.target} does not hash as vLLM does: " + "; ".join(mismatches)
            )

    def _wait_for_idle_pool(self) -> None:
        deadline = time.monotonic() + self.settings.session_ttl_s + 5.0
        while True:
            # Pool-wide: with tenants, the engine's token must be an admin's (it also
            # resets the pool).
            usage = self._call("GetUsage", lambda: self._client.get_usage(pool_wide=True))
            if usage.num_requests == 0 and usage.num_used_blocks == 0:
                return
            if time.monotonic() > deadline:
                raise KVServiceManagerError(
                    f"kvservice at {self.target} still holds {usage.num_used_blocks} blocks "
                    f"for {usage.num_requests} requests of another client: a vLLM engine "
                    "needs a pool of its own (each engine its own kvservice)"
                )
            time.sleep(_IDLE_POLL_S)

    # -- recording the replica's operations ---------------------------------------------

    def check_alive(self) -> None:
        self._link.check_alive()

    def _send_tokens(self, request: Any) -> None:
        """Record ``add_request`` for a request the server has not seen, and an append of
        the tokens it has not received (``ServerRequests`` knows which)."""
        requests = self._requests
        request_id = request.request_id
        tokens, hashes = request._all_token_ids, request.block_hashes
        if not requests.send_tokens(request_id, tokens, request.num_tokens, hashes):
            self._add_request(request)
            requests.send_tokens(request_id, tokens, request.num_tokens, hashes)

    def _add_request(self, request: Any) -> None:
        """Record ``add_request`` for a request the server has not seen: its prompt,
        and what keys its blocks' hashes (or vLLM's hashes themselves)."""
        request_id = request.request_id
        num_prompt_tokens = request.num_prompt_tokens
        hashes = self._requests.add(request_id, num_prompt_tokens, request.block_hashes)
        lora = request.lora_request
        embeds, row_bytes = prompt_embeds_bytes(request)
        self._link.log.add_request(
            request_id,
            # Not prompt_token_ids: None for a prompt of embeddings only.
            request._all_token_ids[:num_prompt_tokens],
            cache_salt=request.cache_salt,
            lora_name=lora.lora_name if lora else None,
            skip_reading_prefix_cache=request.skip_reading_prefix_cache,
            lora_path=lora.lora_path if lora else None,
            lora_int_id=lora.lora_int_id if lora else None,
            prompt_embeds=embeds,
            prompt_embeds_row_bytes=row_bytes,
            # What vLLM's block hasher keys: the item's identifier and placement.
            mm_features=[
                MultiModalFeature(f.identifier, f.mm_position.offset, f.mm_position.length)
                for f in request.mm_features or ()
            ],
            **self._retention_args(request_id),
            block_hashes=hashes,
        )

    def retain(
        self, request_id: str, config: RetentionConfig | None, pin_ttl_s: float | None
    ) -> None:
        """Send ``request_id``'s priorities and ``cache_control`` pin with its
        AddRequest (the server pins; the pin reaches the replica at its boundary)."""
        if config is None and pin_ttl_s is None:
            return
        retention = None if config is None else client_retention(config)
        self._retention[request_id] = (retention, pin_ttl_s)

    def _retention_args(self, request_id: str) -> dict[str, Any]:
        retention, pin_ttl_s = self._retention.pop(request_id, (None, None))
        args: dict[str, Any] = {}
        if retention is not None:
            args["retention"] = retention
        if pin_ttl_s is not None:
            args["cache_control_ttl"] = pin_ttl_s
        return args

    def looked_up(
        self,
        request: Any,
        block_ids: BlockIds,
        num_tokens: int,
        shared_prefix_boundary: int,
        max_cache_hit_length: int | None = None,
    ) -> None:
        """The replica's ``get_computed_blocks`` for ``request`` (capped at
        ``max_cache_hit_length`` tokens) answered this hit."""
        hit = ComputedBlocks(block_ids, num_tokens, shared_prefix_boundary)
        self._send_tokens(request)
        self._lookups[request.request_id] = hit
        if max_cache_hit_length is None:
            # The allocation that attaches it, recorded next, travels with it.
            self._link.log.lookup(request.request_id, hit)
        else:
            args = (request.request_id, max_cache_hit_length)
            self._link.log.record("get_computed_blocks", args, hit)

    def allocated(
        self,
        request: Any,
        num_new_tokens: int,
        hit: tuple[int, BlockIds],
        allocation_options: AllocationOptions,
        answer: BlockIds | None,
        copies: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """The replica's ``allocate_slots`` answered ``answer`` (None: no room) for
        ``request`` with ``hit`` (tokens, block ids) attached and ``allocation_options``,
        queueing ``copies`` (copy-on-write: src, dst)."""
        request_id = request.request_id
        attached = self._attached_hit(request_id, hit) if hit[0] else None
        self._send_tokens(request)
        # Async scheduling keeps steps in flight; only windows read that.
        in_flight = request.num_in_flight_tokens if self._requests.windowed else 0
        self._requests.allocated(
            request_id,
            num_new_tokens,
            request.num_computed_tokens,
            in_flight,
            attached,
            hit[0],
            allocation_options,
            answer,
            copies,
        )
        if answer is not None and attached is not None:
            del self._lookups[request_id]

    def _attached_hit(self, request_id: str, hit: tuple[int, BlockIds]) -> ComputedBlocks:
        """The lookup an allocation attaches: the server takes only its last lookup's
        blocks, so a hit the scheduler changed cannot be forwarded."""
        lookup = self._lookups.get(request_id)
        if lookup is None or (lookup.num_computed_tokens, lookup.block_ids) != hit:
            raise NotImplementedError(
                f"allocate_slots({request_id!r}) attaches a prefix hit other than the last "
                "get_computed_blocks answer; kvservice's remote manager forwards only that one"
            )
        return lookup

    def cached(self, request: Any, num_computed_tokens: int) -> None:
        """The replica's ``cache_blocks(request, num_computed_tokens)`` (vLLM's scheduler
        after a step's outputs, under async scheduling or with draft tokens)."""
        request_id = request.request_id
        if not self._requests.covers_new_blocks(request_id, num_computed_tokens):
            return  # no hash block more than the last call's: nothing to cache
        self._send_tokens(request)
        self._link.log.record("cache_blocks", (request_id, num_computed_tokens), ANY_ANSWER)

    def step_started(self) -> None:
        """The replica's scheduler began a step (``new_step_starts``)."""
        self._link.log.record("new_step_starts", (), ANY_ANSWER)

    def released(self, block_ids: list[int]) -> None:
        """The replica's scheduler released copy holds (``block_pool.free_blocks`` of
        ``take_kv_cache_block_copies``' retained blocks), in this order: the server
        kept the same holds for this."""
        self._link.log.record("free_retained_blocks", (block_ids,), ANY_ANSWER)

    def freed(self, request: Any, keep_blocks: bool = False) -> None:
        """The replica freed ``request`` (finished, or preempted when it is not); with
        ``keep_blocks`` it popped them (``pop_blocks_for_free``) and releases them later
        (``released``), as the server then does."""
        request_id = request.request_id
        # Nothing to free on a server that never had the request.
        if self._requests.freed(request_id, request.is_finished(), keep_blocks):
            self._lookups.pop(request_id, None)

    def evicted(self, block_ids: set[int]) -> None:
        """The replica's ``evict_blocks`` (a KV connector's failed load), in the set's
        order, which orders the removal events on both sides."""
        self._link.log.record("evict_blocks", (list(block_ids),), ANY_ANSWER)

    def skipped(self, request: Any, processed_computed_tokens: int) -> None:
        """The replica's ``remove_skipped_blocks`` for ``request`` (before a finished
        request's blocks go to its KV connector)."""
        if request.request_id in self._requests:
            self._link.log.record(
                "remove_skipped_blocks",
                (request.request_id, processed_computed_tokens),
                ANY_ANSWER,
            )

    # -- sending --------------------------------------------------------------------------

    def flush(self) -> None:
        """Send the recorded operations as one step and check every answer (with
        ``confirm="overlap"``, check them at ``confirm`` instead, before the next step
        is planned)."""
        self._link.flush()

    def confirm(self) -> None:
        """Wait for the last step sent and check its answers."""
        self._link.confirm()

    def reset_prefix_cache(self) -> None:
        """The replica reset its prefix cache: the server must too, once the steps sent
        before it ran (a unary call is not ordered with the stream's messages)."""
        self.confirm()
        if not self._call("ResetPrefixCache", self._client.reset_prefix_cache):
            self._link.fail(
                f"kvservice at {self.target} refused ResetPrefixCache, which the replica accepted"
            )

    def close(self) -> None:
        """Send what is left (the last frees), then end the stream and the session,
        freeing on the server whatever this engine still holds."""
        try:
            if not self._link.failed:
                self.flush()
                self.confirm()
        finally:
            try:
                self._session.close()
                # Ends the session now (freeing what the engine still holds), not when
                # its lease runs out.
                self._lease.close()
            except KVServiceError as error:
                # After a failure the engine has already raised, naming the server; its
                # session's lease frees what it held on a server that is still there.
                if not self._link.failed:
                    raise KVServiceManagerError(
                        f"kvservice at {self.target}: CloseSession failed: {error}"
                    ) from error
            finally:
                self._client.close()
