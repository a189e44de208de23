"""vLLM's ``KVCacheManager`` over a kvservice server, one round trip per scheduler step.

vLLM's scheduler asks its manager synchronously, once per request and step, and acts
on each answer before the next question (a ``None`` preempts, a hit sizes the chunk).
A round trip per question would cost hundreds per step. So the scheduler's process
keeps a replica: the same core, started from the same empty pool, answering at once.
Every call that changes the pool is also recorded, in order, as an operation of one
``Step``, with the answer the replica gave. When the scheduler closes the step (its
``take_kv_cache_block_copies`` call, the last one before the ``SchedulerOutput``
leaves ``schedule()``), the step goes to the server on one ``StepStream`` and every
answer the server gives is compared with the replica's.

The server decides: a step it refuses, an answer that differs, or a server that
cannot be reached raises ``KVServiceManagerError`` (naming the server, the operation
and both answers) before the scheduler's output is used, and the manager refuses every
call after that. Nothing is allocated that the server did not confirm, and no state
diverges silently. The frees and appends that follow the forward pass travel with the
next step.

The replica starts from an empty pool, so the server's pool must be this engine's
alone: at startup the manager waits for the pool to hold no blocks (a previous engine's
lease running out), then resets the prefix cache (the KV those entries described lived
in the previous engine's memory).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any, NoReturn

from kvservice.client import (
    AllocateOptions,
    Allocation,
    CacheConfig,
    ComputedBlocks,
    FreeMode,
    KVClient,
    KVServiceError,
    Session,
    StepResults,
)
from kvservice.integrations.vllm.inprocess import InProcessKVCacheManager
from kvservice.integrations.vllm.settings import ConnectionSettings
from kvservice.integrations.vllm.step_log import ANY_ANSWER, Expected, StepLog

# How often startup polls a pool that a previous engine's lease still holds.
_IDLE_POLL_S = 0.5


class KVServiceManagerError(RuntimeError):
    """The kvservice server could not be reached, refused a step, or answered otherwise
    than the scheduler's replica: the manager stops, since the two no longer agree."""


class ServerConfigMismatchError(KVServiceManagerError):
    """The server's pool is not the one vLLM computed; the message names both."""


BlockIds = tuple[tuple[int, ...], ...]


def seed_fingerprint(seed: str) -> str:
    """``GetCacheConfigResponse.none_hash_seed_fingerprint`` of ``seed``: the first 16
    hex digits of its SHA-256, so the seed itself never crosses the wire."""
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def _ids(blocks: Any) -> BlockIds:
    return tuple(tuple(block.block_id for block in group) for group in blocks.blocks)


class RemoteKVCacheManager(InProcessKVCacheManager):
    """``KVServiceKVCacheManager`` with a kvservice server as the authority
    (``KVSERVICE_TARGET`` set); see the module docstring."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings = ConnectionSettings.from_env()
        target = self.settings.target
        assert target is not None, "RemoteKVCacheManager needs KVSERVICE_TARGET"
        self.target = target
        self._failure: KVServiceManagerError | None = None
        self._client = self._call(
            "connect",
            lambda: KVClient(
                target,
                client_id=self.settings.client_id,
                timeout=self.settings.timeout_s,
                token=self.settings.token,
                tls=self.settings.tls,
                root_certificates=self.settings.root_certificates,
                certificate_chain=self.settings.certificate_chain,
                private_key=self.settings.private_key,
            ),
        )
        self.server_config: CacheConfig = self._call(
            "GetCacheConfig", self._client.get_cache_config
        )
        self._check_layout(self.server_config)
        # A restarted engine opens with a higher epoch, which fences its predecessor.
        self._call(
            "OpenSession",
            lambda: self._client.open_session(
                self.settings.session_ttl_s,
                epoch=time.time_ns() // 1000,
                client_name=self.settings.client_id,
            ),
        )
        self._wait_for_idle_pool()
        if not self._call(
            "ResetPrefixCache", lambda: self._client.reset_prefix_cache(fresh_pool=True)
        ):
            raise KVServiceManagerError(f"kvservice at {target} refused to reset its prefix cache")
        self._session: Session = self._call("StepStream", self._client.session)
        self._log = StepLog()
        # Tokens the server has of each request, and its num_computed_tokens.
        self._server_tokens: dict[str, int] = {}
        self._server_computed: dict[str, int] = {}
        # The last lookup of each waiting request: what its allocation attaches.
        self._lookups: dict[str, ComputedBlocks] = {}
        self.round_trips = 0

    # -- startup --------------------------------------------------------------------

    def _call(self, name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except KVServiceError as error:
            raise KVServiceManagerError(
                f"kvservice at {self.target}: {name} failed: {error}"
            ) from error

    def _check_layout(self, server: CacheConfig) -> None:
        """The server's pool must be the one vLLM computed: same groups, block sizes,
        windows, pool size and policy (hashing is checked by ``check_hashing``, which
        knows vLLM's algorithm)."""
        managers = self.core.coordinator.single_type_managers
        num_blocks = self.args.kv_cache_config.num_blocks
        # (what, vLLM's value, kvservice's value, how to fix it)
        comparisons = [
            (
                "KV cache groups (kind, block size)",
                [(m.kv_cache_spec.kind.value, m.block_size) for m in managers],
                [(group.kind, group.block_size) for group in server.groups],
                "",
            ),
            (
                "sliding windows",
                [getattr(m.kv_cache_spec, "sliding_window", None) for m in managers],
                [group.sliding_window for group in server.groups],
                " (kvservice --sliding-window)",
            ),
            (
                "num_blocks",
                num_blocks,
                server.num_blocks,
                f" (start kvservice with --num-blocks {num_blocks}, or vLLM with "
                f"--num-gpu-blocks-override {server.num_blocks})",
            ),
            (
                "watermark blocks",
                self.core.watermark_blocks,
                server.watermark_blocks,
                f" (start kvservice with --watermark {self.args.watermark})",
            ),
            (
                "prefix caching",
                self.args.enable_caching,
                server.enable_caching,
                " (kvservice --enable-caching / --no-enable-caching)",
            ),
        ]
        mismatches = [
            f"{what}: vLLM {ours}, kvservice {theirs}{hint}"
            for what, ours, theirs, hint in comparisons
            if ours != theirs
        ]
        if server.max_model_len < self.args.max_model_len:
            mismatches.append(
                f"max_model_len: vLLM {self.args.max_model_len}, kvservice "
                f"{server.max_model_len} (kvservice refuses longer sequences)"
            )
        if mismatches:
            raise ServerConfigMismatchError(
                f"kvservice at {self.target} does not match vLLM's KV cache: "
                + "; ".join(mismatches)
            )

    def check_hashing(self, hash_algo: str, none_hash_seed: str | None) -> None:
        """Refuse a server that hashes blocks otherwise than vLLM: its KV events and
        its prefix cache would name different blocks than vLLM's."""
        server = self.server_config
        mismatches = []
        if server.hash_algo != hash_algo:
            mismatches.append(f"hash algorithm: vLLM {hash_algo}, kvservice {server.hash_algo}")
        if none_hash_seed is not None:
            ours = seed_fingerprint(none_hash_seed)
            if ours != server.none_hash_seed_fingerprint:
                mismatches.append(
                    f"hash seed fingerprint: vLLM {ours}, kvservice "
                    f"{server.none_hash_seed_fingerprint} (set the same PYTHONHASHSEED for "
                    "vLLM and --none-hash-seed for kvservice)"
                )
        if mismatches:
            raise ServerConfigMismatchError(
                f"kvservice at {self.target} does not hash as vLLM does: " + "; ".join(mismatches)
            )

    def _wait_for_idle_pool(self) -> None:
        deadline = time.monotonic() + self.settings.session_ttl_s + 5.0
        while True:
            usage = self._call("GetUsage", self._client.get_usage)
            if usage.num_requests == 0 and usage.num_used_blocks == 0:
                return
            if time.monotonic() > deadline:
                raise KVServiceManagerError(
                    f"kvservice at {self.target} still holds {usage.num_used_blocks} blocks "
                    f"for {usage.num_requests} requests of another client: a vLLM engine "
                    "needs a pool of its own (each engine its own kvservice)"
                )
            time.sleep(_IDLE_POLL_S)

    # -- recording --------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise KVServiceManagerError(
                f"the KV cache manager stopped after an earlier failure: {self._failure}"
            )

    def _send_tokens(self, request: Any) -> None:
        """Record ``add_request`` for a request the server has not seen, then an append
        of the tokens it has not received."""
        request_id = request.request_id
        known = self._server_tokens.get(request_id)
        if known is None:
            if request.mm_features:
                raise NotImplementedError(
                    "multimodal requests are not supported by kvservice's remote manager yet"
                )
            self._log.add_request(
                request_id,
                request.prompt_token_ids,
                request.cache_salt,
                request.lora_request.lora_name if request.lora_request else None,
                request.skip_reading_prefix_cache,
            )
            known = request.num_prompt_tokens
            self._server_computed[request_id] = 0
        if request.num_tokens > known:
            self._log.append_tokens(request_id, request._all_token_ids[known:])
        self._server_tokens[request_id] = request.num_tokens

    # -- the scheduler's calls ------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        self._check_alive()
        if max_cache_hit_length is not None:
            self.refuse_connector_only("get_computed_blocks(max_cache_hit_length=...)", True)
        blocks, num_tokens, boundary = super().get_computed_blocks(request)
        self._send_tokens(request)
        hit = ComputedBlocks(_ids(blocks), num_tokens, boundary)
        self._lookups[request.request_id] = hit
        self._log.record("get_computed_blocks", (request.request_id,), hit)
        return blocks, num_tokens, boundary

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any | None:
        self._check_alive()
        request_id = request.request_id
        hit = self._attached_hit(request_id, num_new_computed_tokens, new_computed_blocks)
        new_blocks = super().allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )
        self._send_tokens(request)
        server_computed = self._server_computed[request_id]
        options = None
        if (
            num_lookahead_tokens
            or num_external_computed_tokens
            or delay_cache_blocks
            or num_encoder_tokens
            or full_sequence_must_fit
            or reserved_blocks
            or not has_scheduled_reqs
            or request.num_computed_tokens != server_computed
        ):
            options = AllocateOptions(
                num_lookahead_tokens=num_lookahead_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                delay_cache_blocks=delay_cache_blocks,
                num_encoder_tokens=num_encoder_tokens,
                full_sequence_must_fit=full_sequence_must_fit,
                reserved_blocks=reserved_blocks,
                has_scheduled_reqs=has_scheduled_reqs,
                num_computed_tokens=(
                    None
                    if request.num_computed_tokens == server_computed
                    else request.num_computed_tokens
                ),
            )
        answer = None if new_blocks is None else _ids(new_blocks)
        self._log.record("allocate_slots", (request_id, num_new_tokens, hit, options), answer)
        if new_blocks is not None:
            self._server_computed[request_id] = (
                request.num_computed_tokens
                + num_new_computed_tokens
                + num_external_computed_tokens
                + num_new_tokens
            )
            self._lookups.pop(request_id, None)
        return new_blocks

    def _attached_hit(
        self, request_id: str, num_new_computed_tokens: int, new_computed_blocks: Any | None
    ) -> ComputedBlocks | None:
        """The lookup an allocation attaches: the server takes only its last lookup's
        blocks, so a hit the scheduler changed cannot be forwarded."""
        if not num_new_computed_tokens:
            return None
        hit = self._lookups.get(request_id)
        if (
            hit is None
            or hit.num_computed_tokens != num_new_computed_tokens
            or new_computed_blocks is None
            or _ids(new_computed_blocks) != hit.block_ids
        ):
            raise NotImplementedError(
                f"allocate_slots({request_id!r}) attaches a prefix hit other than the last "
                "get_computed_blocks answer; kvservice's remote manager forwards only that one"
            )
        return hit

    def free(self, request: Any) -> None:
        self._check_alive()
        request_id = request.request_id
        known = request_id in self._server_tokens
        super().free(request)
        if not known:
            return  # never reached the server: nothing to free there
        finished = request.is_finished()
        mode = FreeMode.FINISH if finished else FreeMode.PREEMPT
        self._log.record("free", (request_id, mode), ANY_ANSWER)
        self._lookups.pop(request_id, None)
        if finished:
            del self._server_tokens[request_id], self._server_computed[request_id]
        else:
            self._server_computed[request_id] = 0

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        raise NotImplementedError(
            "cache_blocks (async scheduling, speculative decoding) is not supported by "
            "kvservice's remote manager"
        )

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise NotImplementedError("evict_blocks is not supported by kvservice's remote manager")

    def reset_prefix_cache(self) -> bool:
        self.flush()
        if not super().reset_prefix_cache():
            return False
        if not self._call("ResetPrefixCache", self._client.reset_prefix_cache):
            self._fail(
                KVServiceManagerError(
                    f"kvservice at {self.target} refused ResetPrefixCache, which the replica "
                    "accepted"
                )
            )
        return True

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        # The scheduler's last manager call before its SchedulerOutput leaves schedule():
        # nothing of this step is used before the server has confirmed it.
        self.flush()
        return super().take_kv_cache_block_copies()

    # -- sending ------------------------------------------------------------------------

    def flush(self) -> None:
        """Send the recorded operations as one step and check every answer."""
        self._check_alive()
        if not self._log:
            return
        step, expected = self._log.build()
        self._log = StepLog()
        self.round_trips += 1
        try:
            results = self._session.step(step, stop_on_error=True)
        except KVServiceError as error:
            self._fail(
                KVServiceManagerError(
                    f"kvservice at {self.target}: Step of {len(step)} operations failed: {error}"
                )
            )
        self._compare(results, expected)

    def _compare(self, results: StepResults, expected: list[Expected]) -> None:
        if not results.ok:
            self._fail_refused(results, expected)
        for item in expected:
            if item.answer is ANY_ANSWER:
                continue
            answer = _comparable(results[item.handle])
            if answer != item.answer:
                self._fail(
                    KVServiceManagerError(
                        f"kvservice at {self.target} answered {item.label} with {answer!r}; "
                        f"the scheduler's replica answered {item.answer!r}. Is another client "
                        "using this pool?"
                    )
                )

    def _fail_refused(self, results: StepResults, expected: list[Expected]) -> None:
        for item in expected:
            error = results.error(item.handle)
            if error is not None:
                self._fail(
                    KVServiceManagerError(
                        f"kvservice at {self.target} refused {item.label}: {error}"
                    )
                )
        self._fail(KVServiceManagerError(f"kvservice at {self.target} refused a step"))

    def _fail(self, error: KVServiceManagerError) -> NoReturn:
        self._failure = error
        raise error

    def close(self) -> None:
        """Send what is left (the last frees), then end the stream and the session,
        freeing on the server whatever this engine still holds."""
        try:
            if self._failure is None:
                self.flush()
        finally:
            self._session.close()
            self._client.close()


def _comparable(answer: Any) -> Any:
    """An answer in the form the replica's expectation takes."""
    if isinstance(answer, Allocation):
        return answer.new_block_ids
    return answer
