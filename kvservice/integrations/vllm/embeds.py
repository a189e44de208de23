"""vLLM's prompt embeddings as kvservice takes them: the raw bytes vLLM hashes."""

from __future__ import annotations

from typing import Any

import torch


def prompt_embeds_bytes(request: Any) -> tuple[bytes | None, int]:
    """The bytes of ``request.prompt_embeds`` as vLLM hashes them (``tensor_data``:
    flattened, contiguous, reinterpreted as bytes) and the bytes per prompt token;
    ``(None, 0)`` for a request without prompt embeddings."""
    embeds = request.prompt_embeds
    if embeds is None:
        return None, 0
    flat = embeds.flatten().cpu().contiguous().view(torch.uint8)
    data = flat.numpy().tobytes()
    return data, len(data) // max(int(embeds.shape[0]), 1)
