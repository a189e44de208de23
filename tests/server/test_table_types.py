"""The request table's per-call answers and arguments are plain classes (compiled, one
is built per lookup or allocation) that still compare, hash and print by value, as the
frozen dataclasses and named tuples they replaced did: the replicated schedulers
compare a replica's answers with the server's."""

from __future__ import annotations

from typing import Any

import pytest

from kvservice.core.allocation_options import AllocationOptions
from kvservice.request_table.types import AllocateArgs, ComputedBlocks

CASES: list[tuple[Any, Any, list[Any]]] = [
    (
        ComputedBlocks(((3, 4), (7,)), 32, 16),
        ComputedBlocks(((3, 4), (7,)), 32, 16),
        [
            ComputedBlocks(((3, 4), (8,)), 32, 16),
            ComputedBlocks(((3, 4), (7,)), 48, 16),
            ComputedBlocks(((3, 4), (7,)), 32, 32),
        ],
    ),
    (
        AllocateArgs(4, 16, ((1,),), AllocationOptions(num_lookahead_tokens=2), 9, 1),
        AllocateArgs(4, 16, ((1,),), AllocationOptions(num_lookahead_tokens=2), 9, 1),
        [
            AllocateArgs(5, 16, ((1,),), AllocationOptions(num_lookahead_tokens=2), 9, 1),
            AllocateArgs(4, 16, ((1,),), AllocationOptions(), 9, 1),
            AllocateArgs(4, 16, ((1,),), AllocationOptions(num_lookahead_tokens=2), None, 1),
        ],
    ),
]


@pytest.mark.parametrize(("value", "same", "others"), CASES, ids=["ComputedBlocks", "AllocateArgs"])
def test_compared_hashed_and_printed_by_value(value: Any, same: Any, others: list[Any]) -> None:
    assert value == same
    assert not value != same  # noqa: SIM202  # __ne__ too
    assert hash(value) == hash(same)
    assert len({value, same, *others}) == 1 + len(others)
    for other in others:
        assert value != other
    assert value != tuple(value._values())  # another type never equals
    assert repr(value) == repr(same)
    assert repr(value).startswith(type(value).__name__ + "(")
    assert (
        eval(
            repr(value), {type(value).__name__: type(value), "AllocationOptions": AllocationOptions}
        )
        == value
    )
