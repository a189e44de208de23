"""Input checks shared by the ops and the attention metadata.

Every check runs before anything is written, so a refused call leaves the KV cache
untouched. Errors are ``InvalidArgumentError`` (a ``ValueError``) from the core, so a
server maps them to ``INVALID_ARGUMENT`` like every other caller mistake.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvservice.core.errors import InvalidArgumentError


def check_dim(name: str, tensor: torch.Tensor, ndim: int, what: str) -> None:
    """Require ``ndim`` dimensions; ``what`` names them for the message."""
    if tensor.dim() != ndim:
        raise InvalidArgumentError(
            f"{name} must be {ndim}-D {what}, got shape {tuple(tensor.shape)}"
        )


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise InvalidArgumentError(
            f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}"
        )


def check_dtype(name: str, tensor: torch.Tensor, expected: torch.dtype, against: str) -> None:
    if tensor.dtype != expected:
        raise InvalidArgumentError(
            f"{name} has dtype {tensor.dtype} but {against} has dtype {expected}"
        )


def check_device(name: str, tensor: torch.Tensor, expected: torch.device, against: str) -> None:
    if tensor.device != expected:
        raise InvalidArgumentError(f"{name} is on {tensor.device} but {against} is on {expected}")


def check_index_tensor(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(f"{name} must be int32 or int64, got {tensor.dtype}")


def check_range(
    name: str, values: torch.Tensor, upper: int, *, allow_padding: bool = False
) -> None:
    """Every value in ``[0, upper)``; with ``allow_padding``, -1 marks a skipped entry.

    One ``aminmax`` (a single device sync on CUDA) rather than a Python loop.
    """
    if values.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(values))
    lowest_allowed = -1 if allow_padding else 0
    if low < lowest_allowed or high >= upper:
        bad = low if low < lowest_allowed else high
        padding = " (-1 marks padding)" if allow_padding else ""
        raise InvalidArgumentError(
            f"{name} holds {bad}, out of range [{lowest_allowed}, {upper}){padding}"
        )


def check_ids_in_range(name: str, ids: Sequence[int], upper: int) -> None:
    """Host-side twin of ``check_range`` for Python lists (no device round trip)."""
    for i in ids:
        if not 0 <= i < upper:
            raise InvalidArgumentError(f"{name} holds {i}, out of range [0, {upper})")


def check_unique(name: str, values: torch.Tensor, *, ignore: int | None = None) -> None:
    """Duplicate write targets make ``index_copy_``/``index_put_`` nondeterministic."""
    kept = values if ignore is None else values[values != ignore]
    if kept.numel() != torch.unique(kept).numel():
        raise InvalidArgumentError(f"{name} has duplicate entries: {kept.tolist()}")
