"""Block hashes a client sends instead of the server computing them.

A scheduler in front of kvservice (vLLM's) has already hashed every prompt block: its
requests carry ``block_hashes``. Hashing them again on the server is most of the
server's admission cost, so a request may come ``client_hashed``: its hashes are the
ones the client sends with AddRequest and with each AppendTokens, and the server
computes none for it (blocks the client sends no hash for are simply not cached).

Trusting a hash is trusting that it fingerprints the tokens it comes with. A client
that lies (claims a hash for other tokens) makes later requests that present the
same hash read KV cache of other tokens. So the trust is per tenant, opt-in, and never
reaches past the tenant's own namespace:

* The default tenant (a server without a tokens file) is trusted only with
  ``--trust-client-block-hashes``. Without tokens every client is the same party,
  which can already reset or free anything in the pool: this is the co-located
  engine's deployment, and the hashes stay vLLM's byte for byte (KV events and
  routers see vLLM's own hashes).
* A named tenant is trusted with ``trust_client_block_hashes = true`` in its table of
  the tokens file. Its claimed hash ``h`` is entered as ``BLAKE2b(h, key=tenant)``, a
  keyed digest no other tenant's client can aim: server-computed hashes of named
  tenants start from a tenant salt, and another trusted tenant's keys are digests
  under another key, so reaching a key of another tenant takes a second preimage.
  A trusted tenant can poison only its own cache; it can neither read nor change any
  other tenant's.
* Everyone else gets FAILED_PRECONDITION for ``client_hashed`` and the server hashes
  as before. Hashes sent without ``client_hashed`` are refused (INVALID_ARGUMENT),
  never silently ignored.

Every claim is checked before anything changes: the pool's hash length, and no more
hashes than the request has full hash blocks (lookahead tokens counted as vLLM does).

Pins name blocks by key too. A request's own cache_control_ttl pin names its blocks
by the hashes it sent. PinPrefix by tokens alone is hashed by the server, so for a
trusted named tenant it names the blocks of its server-hashed requests, not those of
its client_hashed ones (the default tenant's are the same hashes); PinPrefix with the
prefix's block_hashes (``pin_keys``, a trusted tenant only, one per whole block) names
them in the tenant's namespace, as its client_hashed requests' blocks are keyed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

from kvservice.core.block_hashing import BlockHasher
from kvservice.core.errors import FailedPreconditionError, InvalidArgumentError
from kvservice.core.kv_cache_block import BlockHash
from kvservice.request_table.tenancy import DEFAULT_TENANT

_KEY_DOMAIN = b"kvservice-client-block-hashes\x00"


class ClientHashes:
    """Which tenants' hashes the pool takes, and the keys it enters them under."""

    def __init__(self, hasher: BlockHasher, trusted_tenants: Collection[str] = ()) -> None:
        self.trusted_tenants = frozenset(trusted_tenants)
        self._hash_length = len(hasher.none_hash)
        self._hash_block_size = hasher.hash_block_size
        self._lookahead = hasher.num_hash_lookahead_tokens
        # tenant -> BLAKE2b keyed with its namespace's key (the default tenant has none).
        self._tenant_hashers: dict[str, hashlib.blake2b] = {}

    def trusts(self, tenant: str) -> bool:
        return tenant in self.trusted_tenants

    def check_trusted(self, claim: str, tenant: str) -> None:
        """FAILED_PRECONDITION for block hashes a tenant not trusted sends; ``claim``
        names what carries them ("request 'r1' is client_hashed")."""
        if tenant in self.trusted_tenants:
            return
        fix = (
            "start the server with --trust-client-block-hashes"
            if tenant == DEFAULT_TENANT
            else f"set trust_client_block_hashes = true in [tenants.{tenant}] of the tokens file"
        )
        raise FailedPreconditionError(
            f"{claim}, but this server does not trust the caller's block hashes; {fix}, "
            "or send no block hashes (the server then hashes the tokens)"
        )

    def keys(
        self,
        request_id: str,
        tenant: str,
        hashes: Sequence[bytes],
        num_known: int,
        num_tokens: int,
    ) -> list[BlockHash]:
        """The cache keys of ``hashes``, claimed after ``num_known`` earlier ones for a
        request of ``num_tokens`` tokens; INVALID_ARGUMENT for a hash of the wrong
        length or more hashes than full blocks."""
        num_full = self._num_full_blocks(num_tokens)
        if num_known + len(hashes) > num_full:
            raise InvalidArgumentError(
                f"request {request_id!r}: {num_known + len(hashes)} block hashes for "
                f"{num_full} full blocks of {self._hash_block_size} tokens (of its "
                f"{num_tokens} tokens, {self._lookahead} lookahead); send a hash only "
                "for a block the tokens sent so far complete"
            )
        return self._checked_keys(f"request {request_id!r}", tenant, hashes)

    def pin_keys(self, tenant: str, hashes: Sequence[bytes], num_tokens: int) -> list[BlockHash]:
        """The cache keys of a pin's claimed ``hashes``: one for each whole block of its
        ``num_tokens`` tokens, as the server would hash them (INVALID_ARGUMENT
        otherwise, and for a hash of the wrong length); FAILED_PRECONDITION for a
        tenant not trusted."""
        self.check_trusted("pin: block_hashes are set", tenant)
        num_blocks = self._num_full_blocks(num_tokens)
        if len(hashes) != num_blocks:
            raise InvalidArgumentError(
                f"pin: {len(hashes)} block_hashes for the {num_blocks} whole blocks of "
                f"{self._hash_block_size} tokens its tokens fill; send one hash per whole "
                "block, as the tenant's client_hashed requests do"
            )
        return self._checked_keys("pin", tenant, hashes)

    def _num_full_blocks(self, num_tokens: int) -> int:
        """The blocks ``num_tokens`` tokens complete, as the hasher counts them
        (lookahead tokens left out, as vLLM does)."""
        return max(0, num_tokens - self._lookahead) // self._hash_block_size

    def _checked_keys(self, subject: str, tenant: str, hashes: Sequence[bytes]) -> list[BlockHash]:
        """The keys of ``hashes`` in ``tenant``'s namespace; INVALID_ARGUMENT for a hash
        of the wrong length (``subject`` names the claim in the message)."""
        length = self._hash_length
        for index, block_hash in enumerate(hashes):
            if len(block_hash) != length:
                raise InvalidArgumentError(
                    f"{subject}: block_hashes[{index}] has {len(block_hash)} bytes; this "
                    f"pool's hashes have {length}"
                )
        if tenant == DEFAULT_TENANT:
            return list(hashes)
        keyed = self._tenant_hasher(tenant)
        keys: list[BlockHash] = []
        for block_hash in hashes:
            hasher = keyed.copy()
            hasher.update(block_hash)
            keys.append(hasher.digest())
        return keys

    def _tenant_hasher(self, tenant: str) -> hashlib.blake2b:
        """A BLAKE2b keyed with ``tenant``'s key, to copy per hash: a keyed hasher
        compresses its key block when it is made, which a copy does not repeat."""
        hasher = self._tenant_hashers.get(tenant)
        if hasher is None:
            key = hashlib.blake2b(_KEY_DOMAIN + tenant.encode(), digest_size=64).digest()
            hasher = hashlib.blake2b(key=key, digest_size=self._hash_length)
            self._tenant_hashers[tenant] = hasher
        return hasher
