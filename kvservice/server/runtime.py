"""The co-located runtime: KV tensors in the server's own process (``--runtime torch``).

With a runtime the server owns the KV cache memory as well as its block table, so it
zeroes every freshly allocated block itself before the answer that hands the block
out leaves the server (``kvservice.request_table.runtime_sync``; see
``AllocateSlotsResponse`` in the proto). Without one (the default) a remote worker
owns the tensors and the answers list the blocks for it to zero.

PyTorch is imported here lazily, only when a runtime is asked for: the default
``kvservice serve`` never imports it, which keeps its startup light and lets it run
where torch is not installed. ``gpu_runtime`` never imports the server; the server
imports it.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

import structlog

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import AttentionSpec, KVCacheConfig
from kvservice.server.config import ServerConfig
from kvservice.server.errors import RuntimeUnavailableError

if TYPE_CHECKING:  # only for annotations: importing gpu_runtime imports torch
    from gpu_runtime.runtime import KVCacheRuntime

log = structlog.get_logger("kvservice.runtime")

RUNTIMES = ("none", "torch")
DEVICES = ("cpu", "cuda")


def check_runtime_options(config: ServerConfig) -> None:
    """Refuse combinations that mean nothing, before anything is imported or sized.

    Raises ``InvalidArgumentError``.
    """
    if config.runtime not in RUNTIMES:
        raise InvalidArgumentError(f"runtime must be one of {', '.join(RUNTIMES)}")
    if config.device not in DEVICES:
        raise InvalidArgumentError(f"device must be one of {', '.join(DEVICES)}")
    if not config.has_runtime and config.device != "cpu":
        # Without a runtime nothing is allocated anywhere: a device would be ignored.
        raise InvalidArgumentError(
            f"device {config.device!r} needs runtime 'torch' (--runtime torch); without a "
            f"runtime the server holds no KV tensors"
        )
    utilization = config.gpu_memory_utilization
    if utilization is not None:
        if not (config.has_runtime and config.device == "cuda"):
            raise InvalidArgumentError(
                "gpu_memory_utilization sizes the KV tensors from the free CUDA memory: it "
                "needs --runtime torch --device cuda (use kv_cache_memory_bytes otherwise)"
            )
        if not 0 < utilization <= 1:
            raise InvalidArgumentError(
                f"gpu_memory_utilization must be in (0, 1], got {utilization}"
            )
        if config.kv_cache_memory_bytes is not None:
            raise InvalidArgumentError(
                "give one of kv_cache_memory_bytes and gpu_memory_utilization, not both"
            )
    if config.kv_cache_memory_bytes is not None and config.kv_cache_memory_bytes <= 0:
        raise InvalidArgumentError(
            f"kv_cache_memory_bytes must be positive, got {config.kv_cache_memory_bytes}"
        )


def kv_cache_budget(config: ServerConfig) -> int | None:
    """The bytes of KV cache the pool is sized from, or None to use ``num_blocks``.

    On CUDA the budget is checked against (``kv_cache_memory_bytes``) or derived from
    (``gpu_memory_utilization``) the device's real free memory; on the CPU, or without
    a runtime, ``kv_cache_memory_bytes`` is taken as given. Raises
    ``InvalidArgumentError`` or ``RuntimeUnavailableError``.
    """
    check_runtime_options(config)
    on_cuda = config.has_runtime and config.device == "cuda"
    if not on_cuda:
        return config.kv_cache_memory_bytes
    torch = _import_torch()
    _check_cuda(torch)
    free, total = (int(n) for n in torch.cuda.mem_get_info())
    if config.gpu_memory_utilization is not None:
        # vLLM's meaning: the device's used memory (this process's and everyone
        # else's) ends at this fraction of the total; the KV cache gets what is left.
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        if budget <= 0:
            raise RuntimeUnavailableError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no room for "
                f"the KV cache: {total - free} of {total} bytes of the CUDA device are "
                f"already in use"
            )
        return budget
    if config.kv_cache_memory_bytes is not None and config.kv_cache_memory_bytes > free:
        raise RuntimeUnavailableError(
            f"kv_cache_memory_bytes {config.kv_cache_memory_bytes} exceeds the free memory "
            f"of the CUDA device ({free} of {total} bytes)"
        )
    return config.kv_cache_memory_bytes


def build_runtime(config: ServerConfig, kv_cache_config: KVCacheConfig) -> KVCacheRuntime:
    """Allocate the KV tensors of ``kv_cache_config`` on the configured device.

    Raises ``RuntimeUnavailableError`` (torch missing, no CUDA, allocation failed) or
    ``InvalidArgumentError`` (a spec the runtime cannot store).
    """
    check_runtime_options(config)
    torch = _import_torch()
    if config.device == "cuda":
        _check_cuda(torch)
    from gpu_runtime.runtime import KVCacheRuntime  # noqa: PLC0415 (imports torch)

    kv_cache_config = attention_groups_only(kv_cache_config)
    try:
        runtime = KVCacheRuntime(kv_cache_config, config.device)
    except RuntimeError as err:  # torch.OutOfMemoryError included
        num_layers = max(len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
        size = kv_cache_config.page_size_bytes * kv_cache_config.num_blocks * num_layers
        raise RuntimeUnavailableError(
            f"could not allocate {size} bytes of KV cache on {config.device} "
            f"({kv_cache_config.num_blocks} blocks): {err}; lower num_blocks or the memory "
            f"budget"
        ) from None
    log.info(
        "runtime ready",
        runtime=config.runtime,
        device=str(runtime.device),
        kv_cache_bytes=runtime.kv_cache.nbytes,
        num_blocks=kv_cache_config.num_blocks,
    )
    return runtime


def attention_groups_only(kv_cache_config: KVCacheConfig) -> KVCacheConfig:
    """The part of the pool the runtime stores: the attention layers. A Mamba state
    group (``mamba_block_size``) draws block ids from the same pool but has no tensors
    here; zeroing or copying a block of it touches attention pages nothing reads."""
    groups = [
        g for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, AttentionSpec)
    ]
    if len(groups) == len(kv_cache_config.kv_cache_groups):
        return kv_cache_config
    return dataclasses.replace(kv_cache_config, kv_cache_groups=groups)


def _import_torch() -> ModuleType:
    try:
        with warnings.catch_warnings():
            # torch warns at import when numpy is absent; the runtime never uses numpy,
            # and the warning would be the first line a `kvservice serve` user reads.
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch  # noqa: PLC0415 (lazy on purpose, see the module docstring)
    except ImportError as err:
        raise RuntimeUnavailableError(
            f"runtime 'torch' needs PyTorch, which is not installed ({err}); install it "
            f"with pip install 'kvservice[runtime]', or run without --runtime"
        ) from None
    return torch


def _check_cuda(torch: ModuleType) -> None:
    if not torch.cuda.is_available():
        raise RuntimeUnavailableError(
            f"device 'cuda' is not available: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); use "
            f"--device cpu, or run where a CUDA device is visible"
        )
