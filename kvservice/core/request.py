"""``Request``: the manager's view of one sequence, and how an allocation advances it."""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Iterable, MutableSequence, Sequence
from operator import attrgetter

from kvservice.core.block_hashing import BlockHasher, MultiModalFeature
from kvservice.core.errors import FailedPreconditionError, InvalidArgumentError
from kvservice.core.kv_cache_block import BlockHash
from kvservice.core.retention_policy import RetentionConfig


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    """One sequence: its tokens, how many the scheduler has computed, and the hashes of
    its full blocks (computed as blocks fill, prompt and output alike, so a preempted
    request re-hits its own generated blocks).

    ``all_token_ids`` is a list, or an ``array`` when the prompt came as one (a server
    keeps a packed prompt packed); ``token_ids_between`` reads a range as a list.

    ``num_computed_tokens`` is set by the caller, as vLLM's scheduler does after each
    successful ``allocate_slots``. ``num_in_flight_tokens`` is vLLM's count of those
    tokens whose step has not run yet (async scheduling keeps a step in flight while
    it plans the next): windows free blocks only below the tokens actually processed.

    What enters the block hashes besides the tokens: the LoRA adapter (``lora_name``
    and ``lora_path``; a name given without a path keys the path as None), multimodal
    items, the cache salt and the prompt embeddings
    (``prompt_embeds``: the raw bytes of a row-major ``[num_prompt_tokens, hidden]``
    tensor, as vLLM hashes ``tensor_data`` of its rows). ``lora_int_id`` is vLLM's
    ``lora_request.adapter_id``, reported as ``lora_id`` in KV events. ``retention``
    gives the blocks it caches a priority (core/retention.py).
    """

    __slots__ = (
        "_block_hasher",
        "_num_computed_tokens",
        "_prompt_embeds_digests",
        "all_token_ids",
        "block_hashes",
        "cache_salt",
        "client_hashed",
        "has_extra_keys",
        "lora_int_id",
        "lora_name",
        "lora_path",
        "mm_features",
        "num_in_flight_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "prompt_embeds",
        "prompt_embeds_row_bytes",
        "request_id",
        "retention",
        "shared_prefix_boundary",
        "skip_reading_prefix_cache",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hasher: BlockHasher | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Iterable[MultiModalFeature] = (),
        skip_reading_prefix_cache: bool = False,
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        prompt_embeds: bytes | None = None,
        retention: RetentionConfig | None = None,
        client_hashed: bool = False,
    ) -> None:
        if not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        self.request_id = request_id
        # An array stays one: a server holds a packed prompt in the 4 bytes per id it
        # came in, not as a Python int per id (36 bytes, allocated and freed).
        self.all_token_ids: MutableSequence[int] = (
            array(prompt_token_ids.typecode, prompt_token_ids)
            if isinstance(prompt_token_ids, array)
            else list(prompt_token_ids)
        )
        if not self.all_token_ids:
            raise InvalidArgumentError(f"request {request_id!r}: the prompt is empty")
        self.num_prompt_tokens = len(self.all_token_ids)
        self.cache_salt = cache_salt or None
        # A LoRA adapter is keyed by name and path: re-pointing a name at another
        # adapter must not reuse its KV. ``lora_int_id`` only labels KV events.
        self.lora_name = lora_name or None
        self.lora_path = lora_path
        self.lora_int_id = lora_int_id
        # Most requests have no items, and sorted(key=) compiles to a generic call.
        features = list(mm_features)
        self.mm_features: list[MultiModalFeature] = (
            sorted(features, key=attrgetter("offset")) if features else features
        )
        for f in self.mm_features:
            if f.offset < 0 or f.length <= 0 or f.offset + f.length > self.num_prompt_tokens:
                raise InvalidArgumentError(
                    f"request {request_id!r}: multimodal item {f.identifier!r} at offset "
                    f"{f.offset} with length {f.length} does not lie inside the "
                    f"{self.num_prompt_tokens}-token prompt"
                )
        self.prompt_embeds = prompt_embeds
        self.prompt_embeds_row_bytes = self._row_bytes(prompt_embeds)
        self._prompt_embeds_digests: dict[tuple[int, int], bytes] = {}
        self.has_extra_keys = bool(
            self.lora_name or self.mm_features or self.cache_salt or prompt_embeds is not None
        )
        # Prompt-logprob and pooling requests must recompute every token: they write
        # the prefix cache but never read it.
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        # Priorities for the blocks this request caches (the priority eviction policy).
        self.retention = retention
        self.status = RequestStatus.WAITING
        # Set by get_computed_blocks when some group matched further than the joint hit:
        # the junction later requests sharing this prefix will resume from.
        self.shared_prefix_boundary: int | None = None
        self.num_preemptions = 0
        self._num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.block_hashes: list[BlockHash] = []
        # The caller enters this request's hashes as its blocks fill (a client the
        # server trusts to hash as it would); no hasher then.
        self.client_hashed = client_hashed
        self._block_hasher = None if client_hashed else block_hasher
        self._update_block_hashes()

    def _row_bytes(self, prompt_embeds: bytes | None) -> int:
        """Bytes per token of the prompt embeddings (row-major, one row per token)."""
        if prompt_embeds is None:
            return 0
        if not prompt_embeds or len(prompt_embeds) % self.num_prompt_tokens:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: {len(prompt_embeds)} bytes of prompt "
                f"embeddings do not split into one row per prompt token "
                f"({self.num_prompt_tokens} tokens)"
            )
        return len(prompt_embeds) // self.num_prompt_tokens

    def prompt_embeds_digest(self, start: int, end: int) -> bytes:
        """SHA-256 of the prompt embeddings of tokens ``[start, end)`` (empty past the
        prompt), computed once per window as vLLM does."""
        assert self.prompt_embeds is not None
        window = (start, end)
        digest = self._prompt_embeds_digests.get(window)
        if digest is None:
            row = self.prompt_embeds_row_bytes
            digest = hashlib.sha256(self.prompt_embeds[start * row : end * row]).digest()
            self._prompt_embeds_digests[window] = digest
        return digest

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids_between(0, self.num_prompt_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids_between(self.num_prompt_tokens, len(self.all_token_ids))

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` as a list, whatever ``all_token_ids`` holds them in."""
        ids = self.all_token_ids[start:end]
        return ids if isinstance(ids, list) else list(ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if value < 0:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: num_computed_tokens must be >= 0, got {value}"
            )
        self._num_computed_tokens = value

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens and hash any block they complete."""
        if self.status is RequestStatus.FINISHED:
            raise FailedPreconditionError(
                f"request {self.request_id!r} is finished; it takes no more tokens"
            )
        ids = self.all_token_ids
        if not isinstance(ids, list):
            self._append_to_packed(ids, token_ids)
        elif isinstance(token_ids, int):
            ids.append(token_ids)
        else:
            ids.extend(token_ids)
        self._update_block_hashes()

    def _append_to_packed(self, ids: MutableSequence[int], token_ids: int | Iterable[int]) -> None:
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        num_ids = len(ids)
        try:
            ids.extend(new)
        except OverflowError:
            # An id past a packed prompt's 32 bits (an append may carry any int64):
            # undo what extend appended before it and hold the ids as ints from here.
            del ids[num_ids:]
            self.all_token_ids = [*ids, *new]

    def preempt(self) -> None:
        """Mark the request preempted, as vLLM's scheduler does after freeing it: its KV
        cache is gone, so it is recomputed from token 0 (usually hitting its own
        freed, still-cached blocks)."""
        self.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._num_computed_tokens = 0

    def _update_block_hashes(self) -> None:
        hasher = self._block_hasher
        if hasher is None:
            return
        self.block_hashes.extend(hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self._num_computed_tokens}, status={self.status.name})"
        )


def computed_after_allocation(
    num_computed_tokens: int, num_hit_tokens: int, num_external_tokens: int, num_new_tokens: int
) -> int:
    """A request's computed tokens after an ``allocate_slots`` that fitted, as vLLM's
    scheduler counts them right after scheduling: the prefix hit it attached, the
    tokens a KV connector loads, then the tokens the step computes. The one statement
    of the rule: the request table applies it, and the vLLM integration's remote link
    tracks the server's count by it."""
    return num_computed_tokens + num_hit_tokens + num_external_tokens + num_new_tokens
