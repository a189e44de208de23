"""How much one caller may send and hold: the sizes of a request's fields and, per
tenant, the requests it holds, the tokens of those waiting and the multimodal items
(and their identifiers' bytes) they keep.

Waiting requests hold no blocks, so neither the pool nor a tenant's ``max_blocks``
bounds the memory they take; nor does anything bound a string field but the message
size, nor the prompt embeddings a request keeps until it finishes. These limits do. A
field too long, or a prompt with too many multimodal items, is refused
INVALID_ARGUMENT (malformed whatever the state); a request past a tenant's count,
waiting-token, prompt-embeddings or multimodal limit RESOURCE_EXHAUSTED (``LimitExceededError``:
finish some first). Each message names the limit by its setting's name, and each refusal is
reported to the table's refusal sink under that name (the server counts them in
``kvservice_refusals_total{reason}``). The per-tenant counts themselves are kept by
``tenancy.RequestLedger``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Final

from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.errors import InvalidArgumentError

# How much of an over-long value an error message quotes.
QUOTED_CHARS: Final = 32


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The limits of one server; each must be positive.

    Lengths are in characters. The defaults leave room for anything vLLM sends (its
    request ids, salts and LoRA names are short; a multimodal identifier is a 64-digit
    hash or a client's uuid; vLLM allows 999 items per modality and prompt) and bound
    a tenant's waiting requests to a few hundred MB (about 40 bytes per token), the
    prompt embeddings its requests hold to 256 MiB, and the multimodal items they
    keep to a few hundred MB: a million items (vLLM's 999 per modality in a thousand
    requests) and 64 MiB of identifiers (a million of vLLM's 64-digit hashes). An
    item costs about 130 bytes beside its identifier, so a tenant's items take at
    most about 200 MB with the shortest identifiers, and about 100 MB with 256-
    character ones (262,144 items), where nothing bounded them before.
    """

    max_request_id_length: int = 512
    max_cache_salt_length: int = 1024
    max_lora_name_length: int = 256
    # A filesystem path or URI: Linux's PATH_MAX.
    max_lora_path_length: int = 4096
    max_mm_identifier_length: int = 256
    max_mm_items_per_prompt: int = 4096
    max_requests_per_tenant: int = 16_384
    max_waiting_tokens_per_tenant: int = 8_388_608
    # Prompt embeddings stay with their request until it finishes (the blocks past the
    # prompt's full ones are hashed from them later): 256 MiB per tenant.
    max_prompt_embeds_bytes_per_tenant: int = 268_435_456
    # Multimodal items stay with their request until it finishes: per tenant, their
    # number and their identifiers' UTF-8 bytes.
    max_mm_items_per_tenant: int = 1_000_000
    max_mm_identifier_bytes_per_tenant: int = 67_108_864

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{field.name} must be a positive int, got {value!r}")

    def check_request_id(self, request_id: str) -> None:
        """Raise ``LimitError`` for an id over the limit (checked before anything
        else, so no later message quotes it whole)."""
        if len(request_id) > self.max_request_id_length:
            raise LimitError(
                "max_request_id_length",
                f"request_id is {len(request_id)} characters (starting "
                f"{_quoted(request_id)}); this server accepts at most "
                f"{self.max_request_id_length} (max_request_id_length)",
            )

    def check_mm_item_count(self, request_id: str, num_items: int) -> None:
        """Raise ``LimitError`` for a prompt with too many multimodal items; called
        before the items are read, so an oversized list costs nothing."""
        if num_items > self.max_mm_items_per_prompt:
            raise LimitError(
                "max_mm_items_per_prompt",
                f"request {request_id!r}: {num_items} multimodal items; this server "
                f"accepts at most {self.max_mm_items_per_prompt} per prompt "
                f"(max_mm_items_per_prompt)",
            )

    def check_fields(
        self,
        request_id: str,
        cache_salt: str | None,
        lora_name: str | None,
        mm_features: tuple[MultiModalFeature, ...],
        lora_path: str | None = None,
    ) -> None:
        """Raise ``LimitError`` for the first field of a new request over its limit."""
        self.check_request_id(request_id)
        for name, value, limit in (
            ("cache_salt", cache_salt, self.max_cache_salt_length),
            ("lora_name", lora_name, self.max_lora_name_length),
            ("lora_path", lora_path, self.max_lora_path_length),
        ):
            if value and len(value) > limit:
                raise LimitError(
                    f"max_{name}_length",
                    f"request {request_id!r}: {name} is {len(value)} characters (starting "
                    f"{_quoted(value)}); this server accepts at most {limit} "
                    f"(max_{name}_length)",
                )
        self.check_mm_item_count(request_id, len(mm_features))
        limit = self.max_mm_identifier_length
        for index, feature in enumerate(mm_features):
            if len(feature.identifier) > limit:
                raise LimitError(
                    "max_mm_identifier_length",
                    f"request {request_id!r}: mm_features[{index}].identifier is "
                    f"{len(feature.identifier)} characters (starting "
                    f"{_quoted(feature.identifier)}); this server accepts at most {limit} "
                    f"(max_mm_identifier_length)",
                )


class LimitError(InvalidArgumentError):
    """A field over its length limit, or too many multimodal items; ``limit`` names
    the setting."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def mm_identifier_bytes(mm_features: Iterable[MultiModalFeature]) -> int:
    """The UTF-8 bytes of the items' identifiers (what the per-tenant limit counts)."""
    total = 0
    for feature in mm_features:
        identifier = feature.identifier
        if identifier.isascii():
            total += len(identifier)
        else:
            total += len(identifier.encode("utf-8", "surrogatepass"))
    return total


def _quoted(value: str) -> str:
    return repr(value[:QUOTED_CHARS]) + ("..." if len(value) > QUOTED_CHARS else "")
