"""Scheduler steps on the wire: ``NewStepStarts`` (a unary RPC and a Step operation,
ordered among the step's other operations) and what it decides, a Mamba "align"
state cached during a step refused as a prefix hit until the next step, as vLLM's
``cached_blocks_this_step``. ``Admit`` runs inside a step and starts none.

vLLM's own answers for the same sequence are in ``tests/vllm/test_api_parity.py``.
"""

from __future__ import annotations

import dataclasses

from kvservice.client import AdmitStopReason, AsyncKVClient, StepBuilder
from tests.server.support import HYBRID_POOL, tokens
from tests.servers import running_server

# Full attention beside a Mamba "align" group, 16-token blocks hashed whole.
MAMBA_POOL = dataclasses.replace(
    HYBRID_POOL, num_blocks=20, block_size=16, mamba_block_size=16, hash_block_size=0
)
FIRST = tokens(32)  # caches its state at 32 tokens
SECOND = tokens(40)  # shares FIRST's 32 tokens


async def test_a_state_cached_in_a_step_is_hit_from_the_next_one() -> None:
    """Unary calls: the second request's hit on the first's state, cached this step,
    is refused (NO_SPACE: vLLM's None, nothing attached) until NewStepStarts."""
    async with (
        running_server(MAMBA_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await client.new_step_starts()
        await client.add_request("0", FIRST)
        assert await client.allocate_slots("0", 32, await client.get_computed_blocks("0"))
        await client.add_request("1", SECOND)
        hit = await client.get_computed_blocks("1")
        assert hit.num_computed_tokens == 32
        free = (await client.get_usage()).num_free_blocks
        assert await client.allocate_slots("1", 8, hit) is None
        assert (await client.get_usage()).num_free_blocks == free
        assert await client.get_block_ids("1") == ((), ())
        await client.new_step_starts()
        hit = await client.get_computed_blocks("1")
        allocation = await client.allocate_slots("1", 8, hit)
        assert allocation is not None and hit.num_computed_tokens == 32
        assert (await client.audit()).ok


async def test_the_boundary_is_an_operation_of_a_step_in_order() -> None:
    """One Step carries two scheduler steps: the boundary between the refused and the
    accepted allocation is where the operation stands among the others."""
    async with (
        running_server(MAMBA_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await client.add_request("0", FIRST)
        await client.add_request("1", SECOND)
        step = StepBuilder()
        step.new_step_starts()
        step.allocate_slots("0", 32)
        refused = step.admit(["1"], token_budget=8)
        boundary = step.new_step_starts()
        admitted = step.admit(["1"], token_budget=8)
        results = await client.step(step, stop_on_error=True)
        assert results.ok and results[boundary] is None
        assert results[refused].admitted == ()
        assert results[refused].stop_reason is AdmitStopReason.NO_SPACE
        (one,) = results[admitted].admitted
        assert (one.request_id, one.hit.num_computed_tokens, one.num_new_tokens) == ("1", 32, 8)


async def test_admit_starts_no_step() -> None:
    """Two admissions in one Admit are in one step: the second request, hitting the
    state the first just cached, stops it (NO_SPACE) as vLLM's scheduler would;
    announced, the next step admits it with the hit."""
    async with (
        running_server(MAMBA_POOL) as server,
        AsyncKVClient(server.handle.target) as client,
    ):
        await client.new_step_starts()
        await client.add_request("0", FIRST)
        await client.add_request("1", SECOND)
        first = await client.admit(["0", "1"], token_budget=512)
        assert [a.request_id for a in first.admitted] == ["0"]
        assert first.stop_reason is AdmitStopReason.NO_SPACE
        await client.new_step_starts()
        second = await client.admit(["1"], token_budget=512)
        assert second.admitted[0].hit.num_computed_tokens == 32
        assert (await client.audit()).ok
