"""``make serve``'s pool hashes and sizes blocks as vLLM 0.33.0 does by default, so the
README's quick start needs no flag beyond ``--scheduler-cls``."""

from __future__ import annotations

from vllm.config import CacheConfig

from kvservice.server.config import ServerConfig


def test_block_size_is_vllms_default() -> None:
    assert ServerConfig().block_size == CacheConfig.DEFAULT_BLOCK_SIZE


def test_hash_algorithm_is_vllms_default() -> None:
    assert ServerConfig().hash_algo == CacheConfig().prefix_caching_hash_algo
