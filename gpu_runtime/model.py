"""A tiny decoder-only transformer with fixed random weights, for end-to-end checks.

RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP. ``forward`` runs on
the paged KV cache (slot writes + a paged-attention backend); ``forward_dense``
computes a whole sequence from scratch with no cache, as the oracle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)

from gpu_runtime.attention import AttentionBackend, AttentionMetadata, select_backend
from gpu_runtime.kv_cache import PagedKVCache
from gpu_runtime.ops import reshape_and_cache
from kvservice.core.kv_cache_interface import FullAttentionSpec

# (layer, query, key, value) -> attention output, all [tokens, heads, head_size].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class TinyModelConfig:
    """Shapes of the tiny model; ``seed`` fixes its weights."""

    vocab_size: int = 97
    hidden_size: int = 64
    num_layers: int = 3
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn" for i in range(self.num_layers)]

    def kv_cache_spec(self, block_size: int, dtype: str) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=dtype,
        )


class TinyTransformer:
    """The model's weights and its two forward passes (paged and dense)."""

    def __init__(
        self,
        config: TinyModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: AttentionBackend | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.backend = backend or select_backend(
            self.device, config.num_q_heads, config.num_kv_heads, dtype
        )
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def weight(*shape: int) -> torch.Tensor:
            # Drawn in fp32 on the CPU so every dtype and device sees the same weights.
            w = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
            return w.to(device=self.device, dtype=dtype)

        self.embed = weight(c.vocab_size, c.hidden_size) * c.hidden_size**0.5
        q_out = c.num_q_heads * c.head_size
        kv_out = c.num_kv_heads * c.head_size
        self.layers = [
            {
                "qkv": weight(q_out + 2 * kv_out, c.hidden_size),
                "o": weight(c.hidden_size, q_out),
                "gate_up": weight(2 * c.intermediate_size, c.hidden_size),
                "down": weight(c.hidden_size, c.intermediate_size),
            }
            for _ in range(c.num_layers)
        ]
        self.lm_head = weight(c.vocab_size, c.hidden_size)
        inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_size, 2, dtype=torch.float32) / c.head_size)
        )
        self.inv_freq = inv_freq.to(self.device)

    def forward(
        self,
        token_ids: Sequence[int],
        metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Logits ``[num_tokens, vocab]`` (fp32) of the step's new tokens, on the paged
        cache: each layer writes its new keys/values, then attends through the block
        table."""
        positions = [
            s - q + j
            for q, s in zip(metadata.query_lens, metadata.seq_lens, strict=True)
            for j in range(q)
        ]
        layers = [kv_cache.layer(name) for name in self.config.layer_names]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # The metadata was validated when built: no per-layer checks or syncs.
            reshape_and_cache(k, v, layers[layer], metadata.slot_mapping, validate=False)
            return self.backend.forward(q, layers[layer], metadata, validate=False)

        return self._run(token_ids, positions, attend)

    def forward_dense(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits of a whole sequence computed from scratch (no cache): the oracle."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                is_causal=True,
                enable_gqa=True,
            )
            return o.transpose(0, 1)

        return self._run(token_ids, list(range(len(token_ids))), attend)

    def _run(self, token_ids: Sequence[int], positions: list[int], attend: Attend) -> torch.Tensor:
        c = self.config
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.float32, device=self.device)
        angles = pos[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x = self.embed[ids]
        num_tokens = ids.shape[0]
        q_out = c.num_q_heads * c.head_size
        kv_out = c.num_kv_heads * c.head_size
        for i, w in enumerate(self.layers):
            qkv = _rms_norm(x) @ w["qkv"].T
            q = qkv[:, :q_out].view(num_tokens, c.num_q_heads, c.head_size)
            k = qkv[:, q_out : q_out + kv_out].view(num_tokens, c.num_kv_heads, c.head_size)
            v = qkv[:, q_out + kv_out :].reshape(num_tokens, c.num_kv_heads, c.head_size)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            o = attend(i, q, k, v).reshape(num_tokens, q_out)
            x = x + o @ w["o"].T
            gate, up = (_rms_norm(x) @ w["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["down"].T
        return (_rms_norm(x) @ self.lm_head.T).float()


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate pairs (first half, second half) of each head, in fp32.
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
