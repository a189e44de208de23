"""Decode / prefill context parallelism: block geometry seen by the allocator."""

from __future__ import annotations

import pytest

from kvservice.core.errors import InvalidArgumentError
from tests.core.helpers import finish, ids, make_manager, prefill
from tests.core.support import full, sliding


class TestDecodeContextParallelism:
    def test_block_covers_dcp_times_block_size_tokens(self) -> None:
        """DCP 4 at block size 16: a block holds 64 tokens, so 100 tokens take 2."""
        m = make_manager(10, full(16), dcp_world_size=4)
        assert (m.scheduler_block_size, m.hash_block_size) == (64, 64)
        req = m.new_request("0", list(range(100)))
        _, _, new = prefill(m, req)
        assert ids(new) == ([1, 2],)
        assert len(req.block_hashes) == 1

    def test_hits_are_in_scaled_blocks(self) -> None:
        """The same 100-token prompt hits one 64-token block (the cap at 99 tokens
        leaves one whole scaled block)."""
        m = make_manager(10, full(16), dcp_world_size=4)
        req = m.new_request("0", list(range(100)))
        prefill(m, req)
        finish(m, req)
        again = m.new_request("1", list(range(100)))
        hit, num_hit, _ = m.get_computed_blocks(again)
        assert (num_hit, ids(hit)) == (64, ([1],))

    def test_pcp_does_not_change_geometry(self) -> None:
        """PCP gathers K/V after prefill: blocks stay block_size tokens."""
        m = make_manager(10, full(16), pcp_world_size=2)
        _, _, new = prefill(m, m.new_request("0", list(range(40))))
        assert ids(new) == ([1, 2, 3],)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"dcp_world_size": 0}, "dcp_world_size must be >= 1"),
            ({"pcp_world_size": -1}, "pcp_world_size must be >= 1"),
        ],
    )
    def test_bad_world_sizes_are_refused(self, kwargs: dict[str, int], message: str) -> None:
        """World sizes below 1 are refused at construction, naming the field."""
        with pytest.raises(InvalidArgumentError, match=message):
            make_manager(10, full(16), **kwargs)

    def test_dcp_refuses_sliding_window(self) -> None:
        """Only full attention is sharded by DCP."""
        with pytest.raises(InvalidArgumentError, match="shards only full attention"):
            make_manager(10, full(16), sliding(16, 32), dcp_world_size=2)

    def test_pcp_refuses_hybrid(self) -> None:
        """PCP supports one KV cache group."""
        with pytest.raises(InvalidArgumentError, match="one KV cache group"):
            make_manager(10, full(16), sliding(16, 32), pcp_world_size=2)
