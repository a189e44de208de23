"""Bad input: every caller mistake raises the documented error type and leaves the
allocator exactly as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvservice.core.block_hashing import MultiModalFeature
from kvservice.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheError,
    OutOfRangeError,
    RequestNotFoundError,
)
from kvservice.core.invariants import check_invariants
from kvservice.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvservice.core.request import Request, RequestStatus
from tests.core.helpers import decode, finish, full_spec, make_config, make_manager, prefill
from tests.core.support import Snapshot, full, sliding, snapshot


def busy_manager() -> tuple[KVCacheManager, Request]:
    """A manager with one cached-and-freed request and one running request."""
    m = make_manager(11, enable_kv_cache_events=True)
    done = m.new_request("done", [4] * 40)
    prefill(m, done)
    finish(m, done)
    running = m.new_request("run", [4] * 33)
    prefill(m, running)
    decode(m, running, 5)
    m.take_events()
    return m, running


def assert_refused(
    m: KVCacheManager,
    req: Request,
    error: type[Exception],
    call: Callable[[], object],
) -> None:
    """``call`` raises ``error`` and neither the allocator nor the request change."""
    before: Snapshot = snapshot(m)
    request_state = (req.num_computed_tokens, req.status, list(req.block_hashes))
    with pytest.raises(error):
        call()
    assert snapshot(m) == before
    assert (req.num_computed_tokens, req.status, list(req.block_hashes)) == request_state
    check_invariants(m)


class TestErrorTypes:
    def test_hierarchy_and_status(self) -> None:
        """Each error names its gRPC status; the argument errors are ValueErrors and
        the not-found error a LookupError."""
        assert issubclass(InvalidArgumentError, ValueError)
        assert issubclass(OutOfRangeError, ValueError)
        assert issubclass(RequestNotFoundError, LookupError)
        for cls, status in (
            (InvalidArgumentError, "INVALID_ARGUMENT"),
            (OutOfRangeError, "OUT_OF_RANGE"),
            (RequestNotFoundError, "NOT_FOUND"),
            (FailedPreconditionError, "FAILED_PRECONDITION"),
        ):
            assert issubclass(cls, KVCacheError)
            assert cls.status == status


class TestAllocateSlotsBadInput:
    def test_zero_new_tokens_without_external(self) -> None:
        """num_new_tokens 0 with no external tokens is a ValueError (vLLM's guard)."""
        m, _ = busy_manager()
        req = m.new_request("new", [1] * 20)
        assert_refused(m, req, ValueError, lambda: m.allocate_slots(req, 0))
        assert_refused(m, req, InvalidArgumentError, lambda: m.allocate_slots(req, 0))

    @pytest.mark.parametrize(
        "field",
        [
            "num_new_tokens",
            "num_new_computed_tokens",
            "num_lookahead_tokens",
            "num_external_computed_tokens",
            "num_encoder_tokens",
            "reserved_blocks",
        ],
    )
    def test_negative_counts(self, field: str) -> None:
        """A negative count is an invalid argument, whichever count it is."""
        m, running = busy_manager()
        counts: dict[str, int] = {"num_new_tokens": 1, field: -1}
        assert_refused(
            m,
            running,
            InvalidArgumentError,
            lambda: m.allocate_slots(running, **counts),  # type: ignore[arg-type]
        )

    def test_beyond_max_model_len(self) -> None:
        """Tokens past max_model_len are out of range."""
        m = make_manager(11, max_model_len=64)
        req = m.new_request("0", [1] * 70)
        assert_refused(m, req, OutOfRangeError, lambda: m.allocate_slots(req, 65))
        assert m.allocate_slots(req, 64) is not None
        req.num_computed_tokens = 64
        assert_refused(m, req, OutOfRangeError, lambda: m.allocate_slots(req, 1))

    def test_external_tokens_count_toward_max_model_len(self) -> None:
        """External computed tokens count toward the max_model_len limit."""
        m = make_manager(11, max_model_len=64)
        req = m.new_request("0", [1] * 70)
        assert_refused(
            m,
            req,
            OutOfRangeError,
            lambda: m.allocate_slots(req, 16, num_external_computed_tokens=49),
        )

    def test_num_computed_tokens_going_backwards(self) -> None:
        """num_computed_tokens moving backwards without a preemption is a failed
        precondition; after free + preempt the request restarts from 0."""
        m, running = busy_manager()
        assert running.num_computed_tokens == 34
        running.append_output_token_ids(6)
        running.num_computed_tokens = 20
        assert_refused(m, running, FailedPreconditionError, lambda: m.allocate_slots(running, 1))

        running.num_computed_tokens = 34
        m.free(running)
        running.preempt()
        assert running.status == RequestStatus.PREEMPTED
        _, num_hit, new = prefill(m, running)
        assert new is not None
        assert num_hit == 32

    def test_finished_request(self) -> None:
        """A finished request can neither be looked up nor allocated for."""
        m, running = busy_manager()
        running.status = RequestStatus.FINISHED
        assert_refused(m, running, FailedPreconditionError, lambda: m.allocate_slots(running, 1))
        assert_refused(m, running, FailedPreconditionError, lambda: m.get_computed_blocks(running))
        with pytest.raises(FailedPreconditionError):
            running.append_output_token_ids(1)

    def test_computed_tokens_without_blocks(self) -> None:
        """num_new_computed_tokens without new_computed_blocks is an invalid argument."""
        m, _ = busy_manager()
        req = m.new_request("new", [4] * 40)
        assert_refused(m, req, InvalidArgumentError, lambda: m.allocate_slots(req, 8, 32))

    def test_computed_tokens_beyond_given_blocks(self) -> None:
        """num_new_computed_tokens larger than the hit blocks cover is refused."""
        m, _ = busy_manager()
        req = m.new_request("new", [4] * 40)
        hit, num_hit, _ = m.get_computed_blocks(req)
        assert num_hit == 32
        assert_refused(
            m, req, InvalidArgumentError, lambda: m.allocate_slots(req, 1, num_hit + 16, hit)
        )

    def test_hits_with_wrong_group_count(self) -> None:
        """new_computed_blocks must carry one list per KV cache group."""
        m, _ = busy_manager()
        req = m.new_request("new", [4] * 40)
        hit, num_hit, _ = m.get_computed_blocks(req)
        two_groups = KVCacheBlocks((hit.blocks[0], hit.blocks[0]))
        assert_refused(
            m, req, InvalidArgumentError, lambda: m.allocate_slots(req, 8, num_hit, two_groups)
        )

    def test_hits_for_request_already_holding_blocks(self) -> None:
        """Prefix hits attach only at admission: a request holding blocks refuses them."""
        m, running = busy_manager()
        probe = m.new_request("probe", [4] * 40)
        hit, num_hit, _ = m.get_computed_blocks(probe)
        assert num_hit == 32
        assert_refused(
            m, running, FailedPreconditionError, lambda: m.allocate_slots(running, 1, 32, hit)
        )


class TestLookupsOfUnknownRequests:
    def test_get_block_ids_unknown(self) -> None:
        """Asking for the blocks of an id never allocated raises RequestNotFoundError."""
        m, _ = busy_manager()
        before = snapshot(m)
        with pytest.raises(RequestNotFoundError):
            m.get_block_ids("nobody")
        with pytest.raises(LookupError):
            m.get_blocks("nobody")
        with pytest.raises(RequestNotFoundError):
            m.get_num_common_prefix_blocks("nobody")
        assert snapshot(m) == before

    def test_get_block_ids_after_finish(self) -> None:
        """A finished and freed request is forgotten."""
        m, running = busy_manager()
        assert m.get_block_ids("run") == ([1, 2, 3],)
        finish(m, running)
        with pytest.raises(RequestNotFoundError):
            m.get_block_ids("run")

    def test_free_of_unallocated_request_is_a_no_op(self) -> None:
        """Freeing a request that never got blocks (aborted while waiting) changes
        nothing."""
        m, _ = busy_manager()
        before = snapshot(m)
        m.free(m.new_request("ghost", [1, 2, 3]))
        assert snapshot(m) == before


class TestConstructionErrors:
    @pytest.mark.parametrize(
        "build",
        [
            lambda: make_manager(11, max_model_len=0),
            lambda: make_manager(11, watermark=1.0),
            lambda: make_manager(11, watermark=-0.1),
            lambda: make_manager(11, hash_algo="md5"),
            lambda: make_manager(11, hash_block_size=8),
            lambda: make_manager(11, scheduler_block_size=24),
        ],
        ids=[
            "max_model_len-0",
            "watermark-1",
            "watermark-negative",
            "unknown-hash",
            "hash-block-size-differs",
            "scheduler-block-not-multiple",
        ],
    )
    def test_bad_manager_arguments(self, build: Callable[[], KVCacheManager]) -> None:
        """Invalid manager settings are rejected at construction as invalid arguments."""
        with pytest.raises(InvalidArgumentError):
            build()

    def test_block_size_not_multiple_of_hash_block_size(self) -> None:
        """In a hybrid config every block size must be a multiple of hash_block_size."""
        config = make_config(20, full(16), sliding(16, 32))
        with pytest.raises(InvalidArgumentError):
            KVCacheManager(config, 1024, hash_block_size=32, scheduler_block_size=32)

    def test_bad_request_arguments(self) -> None:
        """Requests need an id, tokens, mm items inside the prompt and a non-negative
        computed count."""
        with pytest.raises(InvalidArgumentError):
            Request("", [1, 2])
        with pytest.raises(InvalidArgumentError):
            Request("r", [])
        with pytest.raises(InvalidArgumentError):
            Request("r", [1, 2, 3], mm_features=[MultiModalFeature("img", 2, 5)])
        req = Request("r", [1, 2, 3])
        with pytest.raises(InvalidArgumentError):
            req.num_computed_tokens = -1
        assert req.num_computed_tokens == 0

    def test_bad_specs(self) -> None:
        """Specs reject non-positive sizes and unknown dtypes."""
        with pytest.raises(InvalidArgumentError):
            full_spec(0)
        with pytest.raises(InvalidArgumentError):
            full(16, dtype="float64")
        with pytest.raises(InvalidArgumentError):
            sliding(16, 0)
