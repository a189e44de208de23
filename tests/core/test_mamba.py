"""Mamba groups: one state per request, prefix-cached in vLLM's mode "align" (and in
kvservice's extension "all", at every block boundary), alone and beside attention
groups."""

from __future__ import annotations

import pytest

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_interface import (
    MAMBA_CACHE_MODES,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
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
            (
                {"mamba_cache_mode": "latest"},
                r"mamba_cache_mode 'latest' is not supported; use one of "
                r"\['align', 'none'\] \(vLLM 0.33's modes\), or the kvservice extension 'all'",
            ),
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

    def test_caching_needs_mode_align(self) -> None:
        """Prefix caching with mode "none" has no states to reuse: refused, naming
        vLLM's "align" (kvservice's "all" only as the extension it is)."""
        with pytest.raises(
            InvalidArgumentError, match=r"mamba_cache_mode must be 'align' \(or the kvservice"
        ):
            make_manager(8, mamba(16, "none"))

    def test_mode_all_is_an_extension_never_a_default(self) -> None:
        """vLLM 0.33's modes are "align" and "none"; "all" is accepted only by name and
        the default is "none"."""
        assert MAMBA_CACHE_MODES == ("align", "none")
        assert MambaSpec(16, ((2,),), ("float32",)).mamba_cache_mode == "none"
        assert mamba(16, "all").mamba_cache_mode == "all"

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
        m.new_step_starts()  # states cached in a step are hit from the next one on
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


class TestMambaAlign:
    """Mode "align": the state of a step goes to the block of its last token, the
    positions before it are null, speculative blocks move along."""

    def test_refused_without_prefix_caching(self) -> None:
        """Align mode keeps prefix-cache states: without caching, refused naming the
        field and the values allowed there."""
        with pytest.raises(
            InvalidArgumentError, match=r"mamba_cache_mode must be one of \['none'\]"
        ):
            make_manager(8, mamba(16, "align"), enable_caching=False)

    def test_memory_is_two_states_plus_speculative(self) -> None:
        """The state being written, the one it started from, and the draft states."""
        spec = mamba(16, "align", num_speculative_blocks=2)
        assert spec.max_memory_usage_bytes(4096, 512) == 4 * spec.page_size_bytes

    def test_prefill_hybrid_model_mamba_align(self) -> None:
        """Catalogue 7: [full, mamba_align], 30 blocks: 55 tokens get four attention
        blocks and one state block, at the index of the last token's block; the answer
        lists the null padding before it, as vLLM's (the worker's table stays aligned)."""
        m = make_manager(30, full(16), mamba(16, "align"))
        _, _, new = prefill(m, m.new_request("0", list(range(55))))
        assert ids(new) == ([1, 2, 3, 4], [0, 0, 0, 5])
        assert m.get_block_ids("0") == ([1, 2, 3, 4], [0, 0, 0, 5])

    def test_hybrid_cache_mamba_align_shared_prefix_detection(self) -> None:
        """Catalogue 8: req0 (48 tokens) caches its state at 48; req1 (48 + 7) hits 48;
        req2 (47 of them + 101) hits 0, but full attention matched 32 tokens: the
        shared-prefix boundary is 32."""
        m = make_manager(30, full(16), mamba(16, "align"))
        prompt = list(range(48))
        req0 = m.new_request("0", prompt)
        assert m.get_computed_blocks(req0)[1:] == (0, 0)
        prefill(m, req0)
        assert m.get_computed_blocks(m.new_request("1", [*prompt, *range(7)]))[1:] == (48, 0)
        assert m.get_computed_blocks(m.new_request("2", [*prompt[:-1], 101]))[1:] == (0, 32)

    def test_dynamic_draft_tokens_allocate_nothing_within_the_block(self) -> None:
        """Catalogue 9 (#39271), in our words: draft slots do not grow an align-mode
        table; a decode step with one draft token inside the state's block allocates
        nothing in either group."""
        m = make_manager(30, full(16), mamba(16, "align", num_speculative_blocks=1))
        req = m.new_request("0", list(range(20)))
        _, _, new = prefill(m, req, num_lookahead_tokens=3)
        assert ids(new) == ([1, 2], [0, 3, 4])
        assert m.get_block_ids("0") == ([1, 2], [0, 3, 4])
        req.append_output_token_ids(7)
        assert ids(m.allocate_slots(req, 1, num_lookahead_tokens=1)) == ([], [])

    def test_speculative_block_becomes_the_next_state(self) -> None:
        """The speculative block sits at the table position after the state: crossing
        into the next block makes it the state block and takes one fresh block as the
        new speculative block; the state of two steps ago is freed (still cached)."""
        m = make_manager(10, mamba(4, "align", num_speculative_blocks=1))
        req = m.new_request("0", list(range(6)))
        _, _, new = prefill(m, req)
        assert ids(new) == ([0, 1, 2],)
        assert ids(decode(m, req, 6)) == ([],)
        assert ids(decode(m, req, 7)) == ([],)  # 8 tokens: the state at 8 is cached
        assert m.block_pool.blocks[1].block_hash_num_tokens == 8
        assert ids(decode(m, req, 8)) == ([3],)
        assert m.get_block_ids("0") == ([0, 1, 2, 3],)
        decode(m, req, 9)
        assert m.get_block_ids("0") == ([0, 0, 2, 3],)
        assert m.block_pool.blocks[1].ref_cnt == 0
        assert m.block_pool.blocks[1].block_hash is not None

    def test_speculative_blocks_left_behind_move_to_the_end(self) -> None:
        """A chunk that jumps past the speculative block's position leaves it behind
        the new state: it moves to the end of the table (a null takes its place) and is
        listed among the step's entries; it becomes the state block, a fresh block the
        speculative one."""
        m = make_manager(10, mamba(4, "align", num_speculative_blocks=1))
        req = m.new_request("0", list(range(14)))
        assert ids(m.allocate_slots(req, 4)) == ([1, 2],)
        req.num_computed_tokens = 4
        assert ids(m.allocate_slots(req, 8)) == ([2, 3],)
        assert m.get_block_ids("0") == ([1, 0, 2, 3],)
        assert m.block_pool.blocks[2].block_hash_num_tokens == 12
        req.num_computed_tokens = 12
        assert ids(m.allocate_slots(req, 2)) == ([4],)
        assert m.get_block_ids("0") == ([0, 0, 2, 3, 4],)
        assert m.block_pool.blocks[1].ref_cnt == 0  # the state at 4: read, then freed

    def test_every_block_a_chunk_fills_is_cached(self) -> None:
        """As in vLLM, every non-null block a chunk fills is cached at its block
        boundary, the one holding an earlier step's state too: a chunk from 6 to 12
        tokens registers block index 1 (written at 6) for 8 tokens. vLLM's scheduler
        never ends a chunk inside a block before the prompt's end, which keeps this
        from happening there."""
        m = make_manager(10, mamba(4, "align"))
        req = m.new_request("0", list(range(14)))
        assert ids(m.allocate_slots(req, 6)) == ([0, 1],)
        req.num_computed_tokens = 6
        assert ids(m.allocate_slots(req, 6)) == ([2],)
        assert m.get_block_ids("0") == ([0, 1, 2],)
        assert m.block_pool.blocks[1].block_hash_num_tokens == 8
        assert m.block_pool.blocks[2].block_hash_num_tokens == 12
        m.new_step_starts()
        hit, num_hit, _ = m.get_computed_blocks(m.new_request("1", list(range(14))))
        assert (num_hit, ids(hit)) == (12, ([0, 0, 2],))

    def test_a_state_cached_this_step_is_hit_next_step(self) -> None:
        """vLLM's cached_blocks_this_step: a state cached earlier in the same scheduler
        step is only written by that step's forward pass, so a request hitting it is
        refused (None, nothing attached) until new_step_starts."""
        m = make_manager(20, full(16), mamba(16, "align"))
        m.new_step_starts()  # the caller announces its steps
        prefill(m, m.new_request("0", list(range(32))))  # caches the state at 32
        req1 = m.new_request("1", list(range(40)))
        hit, num_hit, _ = m.get_computed_blocks(req1)
        assert num_hit == 32
        assert not m.probe(req1).would_fit
        assert m.allocate_slots(req1, 8, num_hit, hit) is None
        assert m.coordinator.get_blocks("1") == ([], [])
        m.new_step_starts()
        hit, num_hit, new = prefill(m, req1)
        assert (num_hit, ids(new)) == (32, ([4], [5]))

    def test_without_announced_steps_each_allocation_is_a_step(self) -> None:
        """A caller that never calls new_step_starts (one unaware of steps) is not
        refused for good: each allocate_slots call is a step of its own."""
        m = make_manager(20, full(16), mamba(16, "align"))
        prefill(m, m.new_request("0", list(range(32))))
        _, num_hit, new = prefill(m, m.new_request("1", list(range(40))))
        assert (num_hit, ids(new)) == (32, ([4], [5]))
