"""``AttentionMetadata``: one step's batch for one KV cache group.

Built on the host from the scheduler's numbers (query and sequence lengths, block
tables from ``KVCacheManager.get_block_ids``), validated there once, then moved to the
device, so the per-layer ops and kernels need no further checks or syncs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import cdiv


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Sequence ``i`` has ``query_lens[i]`` new tokens (packed in the query in order)
    that end its ``seq_lens[i]`` tokens; its keys and values live in the blocks of row
    ``i`` of ``block_table``, padded with the null block 0.

    Decode is ``query_lens == 1`` for all sequences; prefill of a prompt whose prefix
    hit the cache is ``query_lens[i] < seq_lens[i]``.
    """

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_size: int
    num_blocks: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens_tensor: torch.Tensor  # [num_seqs] int64
    block_table: torch.Tensor  # [num_seqs, max_blocks] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    # Derived once here rather than per layer: every forward call reads them.
    num_tokens: int = field(init=False)
    max_query_len: int = field(init=False)
    max_seq_len: int = field(init=False)
    is_decode: bool = field(init=False)  # one new token per sequence: batched decode
    # What backends derive from this step's batch (e.g. the decode chunk plan), keyed by
    # the backend; built by the first layer's call and reused by the others.
    plans: dict[Any, Any] = field(
        init=False, default_factory=dict, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        max_query_len = max(self.query_lens, default=0)
        object.__setattr__(self, "num_tokens", sum(self.query_lens))
        object.__setattr__(self, "max_query_len", max_query_len)
        object.__setattr__(self, "max_seq_len", max(self.seq_lens, default=0))
        object.__setattr__(self, "is_decode", max_query_len == 1)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_blocks: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Validate the batch and lay it out as tensors on ``device``.

        Raises ``InvalidArgumentError`` naming the sequence and the offending value:
        mismatched lengths, a query longer than its sequence, a block table too short
        for its sequence, block ids outside ``[0, num_blocks)``, or a new token that
        would be written into the null block.
        """
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise InvalidArgumentError(
                f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and "
                f"block_tables ({len(block_tables)}) must have one entry per sequence"
            )
        if not seq_lens:
            raise InvalidArgumentError("the batch has no sequences")
        tables: list[list[int]] = []
        slots: list[int] = []
        for i, (q_len, s_len, table) in enumerate(
            zip(query_lens, seq_lens, block_tables, strict=True)
        ):
            if not 1 <= q_len <= s_len:
                raise InvalidArgumentError(
                    f"sequence {i}: query_len {q_len} must be in [1, seq_len={s_len}]"
                )
            needed = cdiv(s_len, block_size)
            if len(table) < needed:
                raise InvalidArgumentError(
                    f"sequence {i}: block table has {len(table)} blocks but seq_len {s_len} "
                    f"needs {needed} of {block_size} tokens"
                )
            row = list(table[:needed])
            for block_id in row:
                if not 0 <= block_id < num_blocks:
                    raise InvalidArgumentError(
                        f"sequence {i}: block table holds block {block_id}, out of range "
                        f"[0, {num_blocks})"
                    )
            for pos in range(s_len - q_len, s_len):
                block_id = row[pos // block_size]
                if block_id == 0:
                    raise InvalidArgumentError(
                        f"sequence {i}: token at position {pos} would be written into the "
                        f"null block 0"
                    )
                slots.append(block_id * block_size + pos % block_size)
            tables.append(row)
        width = max(len(row) for row in tables)
        padded = [row + [0] * (width - len(row)) for row in tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)

        def to_device(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        return cls(
            query_lens=tuple(query_lens),
            seq_lens=tuple(seq_lens),
            block_size=block_size,
            num_blocks=num_blocks,
            query_start_loc=to_device(starts),
            seq_lens_tensor=to_device(list(seq_lens)),
            block_table=to_device(padded),
            slot_mapping=to_device(slots),
        )
