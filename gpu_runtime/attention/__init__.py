"""Paged attention: the step's metadata, the backend interface, and the backends.

``select_backend`` picks one automatically (compiled FlexAttention on CUDA when the
shapes allow it, plain PyTorch otherwise); ``KVSERVICE_ATTENTION_BACKEND`` or the
``name`` argument forces one: ``torch``, ``flex`` (compiled) or ``flex-eager``.
"""

from __future__ import annotations

import os

import torch

from gpu_runtime.attention.base import AttentionBackend
from gpu_runtime.attention.flex_backend import FlexAttentionBackend
from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.attention.torch_backend import TorchAttentionBackend
from kvservice.core.errors import InvalidArgumentError

BACKEND_ENV = "KVSERVICE_ATTENTION_BACKEND"
BACKEND_NAMES = ("auto", "torch", "flex", "flex-eager")

__all__ = [
    "BACKEND_ENV",
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "FlexAttentionBackend",
    "TorchAttentionBackend",
    "select_backend",
]


def select_backend(
    device: torch.device | str,
    num_q_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    name: str | None = None,
) -> AttentionBackend:
    """The backend for this device and shape; ``name`` (or the env var) forces one."""
    choice = name or os.environ.get(BACKEND_ENV) or "auto"
    if choice == "torch":
        return TorchAttentionBackend()
    if choice == "flex":
        return FlexAttentionBackend(compile=True)
    if choice == "flex-eager":
        return FlexAttentionBackend(compile=False)
    if choice != "auto":
        raise InvalidArgumentError(
            f"unknown attention backend {choice!r}; use one of {list(BACKEND_NAMES)}"
        )
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and FlexAttentionBackend.supports(num_q_heads, num_kv_heads, dtype):
        return FlexAttentionBackend(compile=True)
    return TorchAttentionBackend()
