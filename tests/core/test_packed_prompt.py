"""A prompt given as an ``array`` stays one: the server keeps a packed prompt as 4 bytes
an id. Everything a request's ids feed (hashes, KV events, lengths, appends) must come
out as it does for the same ids in a list."""

from __future__ import annotations

from array import array

import pytest

from kvservice.core.block_hashing import BlockHasher, MultiModalFeature
from kvservice.core.invariants import check_invariants
from kvservice.core.kv_events import BlockStored
from kvservice.core.request import Request
from tests.core.helpers import make_manager, prefill

PROMPT = [(7 * i) % 50_021 for i in range(70)]


def _pair(hasher: BlockHasher, **kwargs: object) -> tuple[Request, Request]:
    """The same prompt as a list and packed, each in a request of its own."""
    as_list = Request("list", PROMPT, hasher, **kwargs)  # type: ignore[arg-type]
    packed = Request("packed", array("I", PROMPT), hasher, **kwargs)  # type: ignore[arg-type]
    return as_list, packed


def _assert_same(as_list: Request, packed: Request) -> None:
    assert packed.block_hashes == as_list.block_hashes
    assert packed.num_tokens == as_list.num_tokens
    assert packed.num_prompt_tokens == as_list.num_prompt_tokens
    assert packed.prompt_token_ids == as_list.prompt_token_ids
    assert packed.output_token_ids == as_list.output_token_ids
    assert list(packed.all_token_ids) == as_list.all_token_ids


@pytest.mark.parametrize("algo", ["sha256", "xxhash_cbor"])
@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_packed_prompt_hashes_and_grows_as_a_list_does(algo: str, lookahead: int) -> None:
    hasher = BlockHasher(16, algo, num_hash_lookahead_tokens=lookahead)
    as_list, packed = _pair(
        hasher,
        lora_name="adapter",
        lora_path="/adapters/a",
        cache_salt="salt",
        mm_features=[MultiModalFeature("image", 20, 8)],
    )
    assert isinstance(packed.all_token_ids, array)
    _assert_same(as_list, packed)
    for step in ([3], 11, range(40, 75)):
        as_list.append_output_token_ids(step)
        packed.append_output_token_ids(step)
        assert isinstance(packed.all_token_ids, array)
        _assert_same(as_list, packed)
    assert len(packed.block_hashes) == (70 + 1 + 1 + 35 - lookahead) // 16


def test_the_request_owns_a_copy_of_the_array() -> None:
    prompt = array("I", PROMPT)
    request = Request("r", prompt, BlockHasher(16, "sha256"))
    prompt[0] = 99
    request.append_output_token_ids(5)
    assert request.all_token_ids[0] == PROMPT[0]
    assert len(prompt) == len(PROMPT)


def test_ids_are_handed_out_as_lists() -> None:
    request = Request("r", array("I", PROMPT), BlockHasher(16, "sha256"))
    request.append_output_token_ids([1, 2])
    for ids in (
        request.prompt_token_ids,
        request.output_token_ids,
        request.token_ids_between(3, 9),
    ):
        assert type(ids) is list
    assert request.output_token_ids == [1, 2]
    assert request.token_ids_between(3, 9) == PROMPT[3:9]


@pytest.mark.parametrize(
    "appended",
    [[2**32], [5, 2**40, 6], [-1]],
    ids=["past 32 bits", "one of three past 32 bits", "negative"],
)
def test_an_id_a_packed_array_cannot_hold_turns_the_ids_into_ints(appended: list[int]) -> None:
    """An append may carry any int64 (the table refuses only negatives and ids past a
    vocabulary it is told): the request then holds ints, with nothing lost or doubled
    by the append that failed halfway into the array."""
    hasher = BlockHasher(16, "sha256")
    as_list, packed = _pair(hasher)
    for request in (as_list, packed):
        request.append_output_token_ids(list(range(10)))
        request.append_output_token_ids(appended)
    assert type(packed.all_token_ids) is list
    _assert_same(as_list, packed)
    assert packed.output_token_ids == [*range(10), *appended]
    # It goes on growing as a list.
    for request in (as_list, packed):
        request.append_output_token_ids([8] * 20)
    _assert_same(as_list, packed)


def test_events_carry_a_packed_prompts_ids_as_a_list() -> None:
    manager = make_manager(20, enable_kv_cache_events=True)
    requests = {
        "list": manager.new_request("list", PROMPT),
        "packed": manager.new_request("packed", array("I", [t + 1 for t in PROMPT])),
    }
    stored: dict[str, BlockStored] = {}
    for name, request in requests.items():
        prefill(manager, request)
        check_invariants(manager)
        (event,) = manager.take_events()
        assert isinstance(event, BlockStored)
        stored[name] = event
    assert type(stored["packed"].token_ids) is list
    assert stored["packed"].token_ids == [t + 1 for t in PROMPT[:64]]
    assert stored["list"].token_ids == PROMPT[:64]
