"""The vLLM releases the integration runs on, and what kvservice refuses on each.

kvservice's core decides as vLLM 0.33.0's manager. vLLM 0.32's scheduler calls the
manager the same way (it passes no ``num_hash_lookahead_tokens`` and no
``max_cache_hit_length``, which default to what 0.32 means), and its manager decides
as 0.33's on every layout but two (read in 0.32.0's ``vllm/v1/core`` against 0.33.0's;
the scheduler differentials run on both), where kvservice would decide otherwise than the
running vLLM; those are refused when the manager is built, one line naming the version
and the feature, never served with a silent divergence:

- Mamba "align" with prefix caching: 0.32 caches a partial block again when a hit or
  an earlier step already keyed it, which marks it cached in this step and defers
  every request that would hit it; 0.33 leaves it keyed as it was.
- EAGLE drafting with prefix caching: 0.33 keeps a second boundary one block below a
  shared prefix reachable (a sibling diverging right after the junction hits there);
  0.32 caches no block for it (read in the source: no test builds an EAGLE drafter).

Leading null blocks of sliding-window tables (0.32 keeps the null block's reference
count, 0.33 strips them) change no block id nor free count the scheduler sees (the
hybrid sliding-window differential runs on 0.32). A release this module does not name is refused: a
manager decides exactly as one of these or not at all (see the README for adding one).
"""

from __future__ import annotations

from typing import Any

SUPPORTED = ("0.32", "0.33")


def release(version: str) -> str:
    """``"0.33"`` for ``"0.33.0"``, ``"0.33.1rc1"`` or ``"0.33.0+cpu"``."""
    return ".".join(version.split("+", maxsplit=1)[0].split(".")[:2])


def check_release(version: str) -> None:
    """Refuse a vLLM release whose manager kvservice has not been compared with."""
    if release(version) not in SUPPORTED:
        raise NotImplementedError(
            f"kvservice's vLLM integration supports vLLM {' and '.join(SUPPORTED)}, "
            f"not vLLM {version}: install one of those, or run vLLM's built-in manager"
        )


def refuse_divergences(
    version: str, kv_cache_config: Any, enable_caching: bool, use_eagle: bool
) -> None:
    """Refuse what kvservice would decide otherwise than vLLM ``version``'s manager."""
    check_release(version)
    if release(version) != "0.32" or not enable_caching:
        return
    divergent = []
    if any(
        getattr(group.kv_cache_spec, "mamba_cache_mode", None) == "align"
        for group in kv_cache_config.kv_cache_groups
    ):
        divergent.append("Mamba 'align' prefix caching")
    if use_eagle:
        divergent.append("EAGLE drafting with prefix caching")
    if divergent:
        raise NotImplementedError(
            f"kvservice's manager decides {' and '.join(divergent)} as vLLM 0.33 does, "
            f"not as the running vLLM {version}: use vLLM 0.33, or turn prefix caching off "
            "(--no-enable-prefix-caching)"
        )
