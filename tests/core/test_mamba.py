"""Mamba groups: one state per request, prefix-cached at block boundaries in mode
"all", alone and beside attention groups."""

from __future__ import annotations

import pytest

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from kvservice.core.kv_cache_manager import KVCacheManager
from tests.core.helpers import decode, finish, free_queue_ids, ids, make_manager, prefill
from tests.core.support import full, sliding


def mamba(block_size: int, mode: str = "all", num_speculative_blocks: int = 0) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((2, 512), (3, 32, 32)),
        dtypes=("float32", "float32"),
        mamba_cache_mode=mode,
        num_speculative_blocks=num_speculative_blocks,
    )


class TestMambaSpec:
    def test_page_size_is_the_state_size(self) -> None:
        """A page holds the whole state: (2*512 + 3*32*32) float32 = 16 KiB; padding wins."""
        assert mamba(16).page_size_bytes == 16384
        padded = MambaSpec(16, ((2, 512),), ("float32",), page_size_padded=32768)
        assert padded.page_size_bytes == 32768

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"mamba_cache_mode": "align"}, "mamba_cache_mode 'align' is not supported"),
            ({"num_speculative_blocks": -1}, "num_speculative_blocks must be >= 0"),
            ({"dtypes": ("float32",)}, "one dtype"),
        ],
    )
    def test_bad_specs_are_refused(self, kwargs: dict[str, object], message: str) -> None:
        """Unsupported modes and malformed states are refused, naming the field."""
        fields: dict[str, object] = {
            "block_size": 16,
            "shapes": ((2, 512), (3, 32, 32)),
            "dtypes": ("float32", "float32"),
        }
        fields.update(kwargs)
        with pytest.raises(InvalidArgumentError, match=message):
            MambaSpec(**fields)  # type: ignore[arg-type]


class TestMambaWithoutCaching:
    def test_one_state_block_per_request(self) -> None:
        """Mode "none", block = max_model_len: one block per request, plus one per
        speculative block, and decoding never allocates again."""
        m = make_manager(
            8,
            mamba(256, "none", num_speculative_blocks=2),
            max_model_len=256,
            enable_caching=False,
        )
        req = m.new_request("0", list(range(100)))
        _, _, new = prefill(m, req)
        assert ids(new) == ([1, 2, 3],)
        assert ids(decode(m, req, 7)) == ([],)

    def test_caching_needs_mode_all(self) -> None:
        """Prefix caching with mode "none" has no states to reuse: refused."""
        with pytest.raises(InvalidArgumentError, match="mamba_cache_mode 'none'"):
            make_manager(8, mamba(16, "none"))

    def test_mode_all_needs_caching(self) -> None:
        """Mode "all" without prefix caching is a contradiction: refused."""
        with pytest.raises(InvalidArgumentError, match="needs prefix caching"):
            make_manager(8, mamba(16, "all"), enable_caching=False)


class TestMambaPrefixCaching:
    def test_only_the_latest_state_is_held(self) -> None:
        """After a 40-token prefill, the next step releases the states before the last
        computed token's block, last first; they stay cached."""
        m = make_manager(8, mamba(16))
        req = m.new_request("0", list(range(40)))
        _, _, new = prefill(m, req)
        assert ids(new) == ([1, 2, 3],)
        decode(m, req, 40)
        assert m.get_block_ids("0") == ([0, 0, 3],)
        assert free_queue_ids(m)[-2:] == [2, 1]
        assert m.block_pool.blocks[2].block_hash is not None

    def test_hit_is_the_latest_cached_state(self) -> None:
        """The same prompt hits the state at token 32 alone ([NULL, B2]); touching the
        free state costs one block of capacity beside the one new block."""
        m = make_manager(8, mamba(16))
        req = m.new_request("0", list(range(40)))
        prefill(m, req)
        finish(m, req)
        again = m.new_request("1", list(range(40)))
        free_before = m.block_pool.get_num_free_blocks()
        hit, num_hit, new = prefill(m, again)
        assert (num_hit, ids(hit)) == (32, ([0, 2],))
        assert ids(new) == ([3],)
        assert free_before - m.block_pool.get_num_free_blocks() == 2
        assert m.get_block_ids("1") == ([0, 2, 3],)

    def test_hybrid_with_full_attention(self) -> None:
        """[Full, Mamba]: the joint hit is the latest Mamba state that full attention
        also covers."""
        m = make_manager(30, full(16), mamba(16))
        req0 = m.new_request("0", [*range(64), 99, 98, 97, 96, 95])
        prefill(m, req0)
        req1 = m.new_request("1", [*range(64), 1, 2])
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert num_hit == 64
        assert [len(group) for group in hit.blocks] == [4, 4]
        assert hit.get_block_ids()[1][:3] == [0, 0, 0]

    def test_hybrid_mamba_bounds_full_attention(self) -> None:
        """When the newest Mamba state is gone, the hit falls back to an older state and
        full attention is trimmed to it."""
        m = make_manager(40, full(16), sliding(16, 32), mamba(16))
        req0 = m.new_request("0", [*range(64), 99])
        prefill(m, req0)
        mamba_blocks = m.get_block_ids("0")[2]
        m.evict_blocks({mamba_blocks[3]})
        hit, num_hit, _ = m.get_computed_blocks(m.new_request("1", [*range(64), 5]))
        assert num_hit == 48
        assert [len(group) for group in hit.blocks] == [3, 3, 3]

    def test_eagle_cannot_be_marked_on_mamba(self) -> None:
        """A drafter has no Mamba state: marking a Mamba group as EAGLE is refused, and
        unmarked EAGLE applies to the attention groups only."""
        groups = [
            KVCacheGroupSpec(["attn"], full(16)),
            KVCacheGroupSpec(["ssm"], mamba(16), is_eagle_group=True),
        ]
        with pytest.raises(InvalidArgumentError, match="EAGLE"):
            KVCacheManager(KVCacheConfig(20, [], groups), 4096, use_eagle=True)
        m = make_manager(20, full(16), mamba(16), use_eagle=True)
        assert [s.use_eagle for s in m.coordinator.single_type_managers] == [True, False]
