"""A KV-aware router reproduces a named tenant's block hashes with vLLM's own hasher,
given the tenant's salt as the request's cache_salt (the README's claim)."""

from __future__ import annotations

import pytest

from kvservice.core.block_hashing import BlockHasher
from kvservice.core.request import Request
from kvservice.request_table.tenancy import tenant_cache_salt
from tests.vllm.support import vllm_hashed_request


@pytest.mark.parametrize("cache_salt", [None, "user-salt"])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_a_tenants_hashes_are_vllms_with_the_tenant_salt(algo: str, cache_salt: str | None) -> None:
    salt = tenant_cache_salt("team-a", cache_salt)
    assert salt is not None
    prompt = list(range(1000, 1100))
    ours = Request("r", prompt, BlockHasher(16, algo), cache_salt=salt)
    theirs = vllm_hashed_request("r", prompt, algo, cache_salt=salt)
    assert ours.block_hashes == theirs.block_hashes and len(ours.block_hashes) == 6
