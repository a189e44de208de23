"""Partial-block prefix hits over gRPC: a hybrid pool (full attention beside a Mamba
"align" group, hash block smaller than the blocks) answers a hit that ends inside a
block with a copy-on-write copy, which a remote worker applies
(``block_copies_to_apply``) or the co-located runtime already applied
(``block_copies_applied``) before the answer arrives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvservice.client import AsyncKVClient, FreeMode, StepBuilder
from kvservice.client.types import Allocation
from kvservice.core.errors import InvalidArgumentError
from kvservice.server.config import build_kv_cache_config
from kvservice.server.settings import load_settings
from tests.server.support import HYBRID_POOL
from tests.servers import running_server

# req0's prompt; its first chunk (one hash block) ends on the prompt's last reusable
# boundary (num_prompt_tokens - 1 rounded down, as vLLM 0.33 registers it), so its
# state and KV there are a partial entry.
PROMPT = [11, 12, 13, 14, 19]
CHUNK = 4
SHARING = [11, 12, 13, 14, 15, 16, 17, 18]  # req1: PROMPT's first chunk, then its own


async def partial_hit(client: AsyncKVClient) -> tuple[Allocation, list[list[int]]]:
    """req0 computes PROMPT's first chunk; req1 (that chunk + 4 tokens) hits its 4 tokens, which end
    inside an 8-token block of each group. Returns req1's allocation and req0's
    tables (the copies' sources)."""
    await client.add_request("req0", PROMPT)
    first = await client.allocate_slots("req0", CHUNK, await client.get_computed_blocks("req0"))
    assert first is not None
    await client.add_request("req1", SHARING)
    hit = await client.get_computed_blocks("req1")
    assert hit.num_computed_tokens == 4
    allocation = await client.allocate_slots("req1", 4, hit)
    assert allocation is not None
    sources = [list(group) for group in await client.get_block_ids("req0")]
    return allocation, sources


def expected_copies(sources: list[list[int]], allocation: Allocation) -> list[tuple[int, int]]:
    """One copy per group: req0's block (attention block 0, Mamba state block 0) into
    the private block listed first among req1's new blocks of that group."""
    return [(sources[g][0], allocation.new_block_ids[g][0]) for g in range(2)]


async def test_remote_worker_gets_the_copies_to_apply() -> None:
    """No runtime: the answer lists the copies (and the fresh blocks to zero), and the
    private blocks replace the shared ones in req1's tables."""
    async with (
        running_server(HYBRID_POOL) as server,
        AsyncKVClient(server.handle.target, client_id="partial") as client,
    ):
        allocation, sources = await partial_hit(client)
        copies = expected_copies(sources, allocation)
        assert list(allocation.block_copies_to_apply) == copies
        assert allocation.block_copies_applied == ()
        # The attention copy's destination is zeroed first, then copied into; as in
        # vLLM, Mamba state blocks are never zeroed (written whole before read).
        (_, attention_dst), (_, state_dst) = copies
        assert attention_dst in allocation.block_ids_to_zero
        assert state_dst not in allocation.block_ids_to_zero
        tables = await client.get_block_ids("req1")
        assert [t[0] for t in tables] == [dst for _, dst in copies]
        assert all(src not in table for (src, _), table in zip(copies, tables, strict=True))
        report = await client.audit()
        assert report.ok, report.violations


async def test_colocated_runtime_applies_the_copies_before_answering() -> None:
    """With the torch runtime: the answer lists the copies as applied, and each
    destination page of the attention layers equals its source page."""
    config = dataclasses.replace(HYBRID_POOL, runtime="torch", device="cpu")
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target, client_id="partial") as client,
    ):
        runtime = server.handle.runtime
        assert runtime is not None
        await client.add_request("req0", PROMPT)
        first = await client.allocate_slots("req0", CHUNK, await client.get_computed_blocks("req0"))
        assert first is not None
        source = first.new_block_ids[0][0]
        # The model writing req0's KV into its attention block.
        for view in runtime.kv_cache.groups:
            view[:, :, source].copy_(torch.randn_like(view[:, :, source]))
        await client.add_request("req1", SHARING)
        allocation = await client.allocate_slots(
            "req1", 4, await client.get_computed_blocks("req1")
        )
        assert allocation is not None
        dst = allocation.new_block_ids[0][0]
        assert allocation.block_copies_to_apply == ()
        assert (source, dst) in allocation.block_copies_applied
        assert len(allocation.block_copies_applied) == 2  # the Mamba group's copy too
        for view in runtime.kv_cache.groups:
            assert torch.equal(view[:, :, dst], view[:, :, source])
            assert not torch.equal(view[:, :, dst], torch.zeros_like(view[:, :, dst]))
        report = await client.audit()
        assert report.ok, report.violations


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hash_block_size": 3}, "hash_block_size 3 must divide block_size 8"),
        ({"hash_block_size": -4}, "hash_block_size must be >= 0"),
        ({"mamba_block_size": 10}, "hash_block_size 4 must divide mamba_block_size 10"),
    ],
)
def test_bad_hash_block_sizes_are_refused(changes: dict[str, int], message: str) -> None:
    """A hash block that does not divide every block size is refused, naming the
    option and the allowed values."""
    with pytest.raises(InvalidArgumentError, match=message):
        build_kv_cache_config(dataclasses.replace(HYBRID_POOL, **changes))  # type: ignore[arg-type]


def test_options_reach_the_server_config() -> None:
    """``--hash-block-size`` / ``--mamba-block-size`` (here from the environment)."""
    settings = load_settings(
        {}, {"KVSERVICE_HASH_BLOCK_SIZE": "4", "KVSERVICE_MAMBA_BLOCK_SIZE": "16"}
    )
    assert (settings.server.hash_block_size, settings.server.mamba_block_size) == (4, 16)
    groups = build_kv_cache_config(settings.server).kv_cache_groups
    assert [g.kv_cache_spec.block_size for g in groups] == [16, 16]


async def test_a_step_applies_its_copies_after_zeroing_once() -> None:
    """Through Step with the runtime: req1's hit and the owner's FINISH in one step;
    the copy is applied when the step ends, after the zeroing, from a source the
    finished owner no longer holds (the copy's hold kept it until then)."""
    config = dataclasses.replace(HYBRID_POOL, runtime="torch", device="cpu")
    async with (
        running_server(config) as server,
        AsyncKVClient(server.handle.target, client_id="partial") as client,
    ):
        runtime = server.handle.runtime
        assert runtime is not None
        await client.add_request("req0", PROMPT)
        first = await client.allocate_slots("req0", CHUNK, await client.get_computed_blocks("req0"))
        assert first is not None
        source = first.new_block_ids[0][0]
        for view in runtime.kv_cache.groups:
            view[:, :, source].copy_(torch.randn_like(view[:, :, source]))
        written = [view[:, :, source].clone() for view in runtime.kv_cache.groups]
        await client.add_request("req1", SHARING)
        hit = await client.get_computed_blocks("req1")
        step = StepBuilder()
        allocated = step.allocate_slots("req1", 4, hit)
        step.free("req0", FreeMode.FINISH)
        results = await client.step(step)
        allocation = results[allocated]
        assert allocation is not None
        dst = allocation.new_block_ids[0][0]
        assert (source, dst) in allocation.block_copies_applied
        assert dst in allocation.block_ids_zeroed
        for view, before in zip(runtime.kv_cache.groups, written, strict=True):
            assert torch.equal(view[:, :, dst], before)
        report = await client.audit()
        assert report.ok, report.violations
