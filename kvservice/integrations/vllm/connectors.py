"""Which of vLLM's KV connectors kvservice's manager can serve, decided at start.

vLLM's scheduler drives a connector through the manager's methods (external computed
tokens, delayed caching, ``evict_blocks``, deferred frees, ``truncate_computed_blocks``),
and ``KVServiceKVCacheManager`` serves those. A few connectors go further and bind
vLLM's own GPU ``BlockPool`` object (``bind_gpu_block_pool``: ref counts, iterating the
prefix cache) or replace how the manager is bound (``bind_kv_cache_manager``): they
would read a pool kvservice does not have, so they are refused by name before the
scheduler builds them. ``MultiConnector`` is checked connector by connector.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.kv_cache_interface import MambaSpec

# What a connector may override and still run on kvservice's manager: vLLM's base
# binds the manager and hands the pool to a no-op.
_POOL_BINDINGS = ("bind_gpu_block_pool", "bind_kv_cache_manager")


def _connector_classes(kv_transfer_config: Any) -> list[type]:
    """The connector classes ``kv_transfer_config`` builds (a ``MultiConnector``'s each)."""
    cls = KVConnectorFactory.get_connector_class(kv_transfer_config)
    if not issubclass(cls, MultiConnector):
        return [cls]
    children = kv_transfer_config.kv_connector_extra_config.get("connectors") or []
    classes: list[type] = []
    for child in children:
        classes.extend(_connector_classes(type(kv_transfer_config)(**child)))
    return classes


def _binds_block_pool(cls: type) -> str | None:
    for name in _POOL_BINDINGS:
        # vLLM 0.32's base has no bind_gpu_block_pool.
        if getattr(cls, name, None) is not getattr(KVConnectorBase_V1, name, None):
            return name
    return None


def check_connector_classes(vllm_config: Any) -> None:
    """Before the scheduler builds its connector: refuse, naming it, one that binds
    vLLM's block pool."""
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None:
        return
    for cls in _connector_classes(kv_transfer_config):
        binding = _binds_block_pool(cls)
        if binding is not None:
            raise NotImplementedError(
                f"KV connector {cls.__name__} is not supported by KVServiceScheduler: it "
                f"overrides {binding} to use vLLM's own GPU BlockPool, which kvservice's "
                "manager replaces (use vLLM's scheduler for this connector)"
            )


def check_connector(connector: Any, kv_cache_config: Any) -> None:
    """Once built: refuse a connector asking for what the manager does not serve."""
    has_mamba = any(
        isinstance(group.kv_cache_spec, MambaSpec) for group in kv_cache_config.kv_cache_groups
    )
    mamba_align = any(
        isinstance(group.kv_cache_spec, MambaSpec)
        and group.kv_cache_spec.mamba_cache_mode == "align"
        for group in kv_cache_config.kv_cache_groups
    )
    if mamba_align:
        # vLLM's manager hands a connector the boundary states and partial tails of
        # "align" groups (take_boundary_state_offloads, finalize_partial_tail_offloads).
        raise NotImplementedError(
            f"KV connector {type(connector).__name__} is not supported by KVServiceScheduler "
            'with Mamba "align" prefix caching: kvservice\'s manager does not hand a '
            "connector the boundary states it offloads"
        )
    if has_mamba and connector.supports_divergent_local_hybrid_hits:
        raise NotImplementedError(
            f"KV connector {type(connector).__name__} is not supported by KVServiceScheduler "
            "on a Mamba hybrid model: it asks for per-group diverging prefix hits "
            "(get_computed_blocks_for_connector), which kvservice's manager does not serve"
        )
