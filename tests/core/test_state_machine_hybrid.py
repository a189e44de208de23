"""Stateful property tests for the allocator features the machines of
``test_state_machine.py`` leave off: Mamba groups, EAGLE, sparse retention, decode
context parallelism, connector (external) tokens, ``evict_blocks``, ``probe`` and KV
events.

The machines are ``AllocatorMachine`` (same scheduler moves, same per-step model and
checks) over the layouts of ``tests/core/strategies.py``; each layout turns on events
(replayed after every step into a model of the cache), external tokens at admission,
random ``evict_blocks`` and ``probe`` before allocations. The retention oracle the
machine uses is pinned to the catalogue vectors of ``test_retention.py`` here.
"""

from __future__ import annotations

import pytest

from tests.core.strategies import dcp_configs, eagle_configs, mamba_configs, retention_configs
from tests.core.test_state_machine import AllocatorMachine, machine_settings, retained_block


class MambaMachine(AllocatorMachine):
    """(f) Mamba "all" groups alone and beside full attention / sliding windows, with
    speculative state blocks and retention intervals None, 0 and k."""

    configs = mamba_configs()


class EagleMachine(AllocatorMachine):
    """(g) EAGLE on or off, unmarked or with marked drafter groups, for full attention,
    a lone window and hybrid layouts (Mamba included)."""

    configs = eagle_configs()


class RetentionMachine(AllocatorMachine):
    """(h) Sliding-window layouts under retention intervals None, 0 and k."""

    configs = retention_configs()


class ContextParallelMachine(AllocatorMachine):
    """(i) Decode context parallelism 2 or 4 on full attention (and beside Mamba)."""

    configs = dcp_configs()


TestMamba = MambaMachine.TestCase
TestMamba.settings = machine_settings(50, 30)
TestEagle = EagleMachine.TestCase
TestEagle.settings = machine_settings(60, 30)
TestRetention = RetentionMachine.TestCase
TestRetention.settings = machine_settings(30, 30)
TestContextParallel = ContextParallelMachine.TestCase
TestContextParallel.settings = machine_settings(20, 30)


def kept(
    num_blocks: int,
    block_size: int,
    need: int,
    shift: int,
    alignment: int,
    interval: int | None,
    boundaries: tuple[int, ...],
) -> set[int]:
    return {
        i
        for i in range(num_blocks)
        if retained_block(i, block_size, need, shift, alignment, interval, boundaries)
    }


@pytest.mark.parametrize(
    ("retention", "boundaries", "expected"),
    [
        (None, (255,), set(range(16))),  # dense
        (16, (255,), set(range(16))),  # one block per segment: everything is reachable
        (64, (255,), {3, 7, 11, 14, 15}),
        (0, (255,), {14}),
        (0, (255, 96), {5, 14}),
        (0, (255, 100), {5, 14}),  # the junction rounds down to a hit boundary
        (64, (255, 96), {3, 5, 7, 11, 14, 15}),
        (None, (255, 96), set(range(16))),
        (0, (255, 512), {14}),  # beyond the blocks being cached
        (0, (255, 0), {14}),
    ],
)
def test_retention_oracle_one_block_windows(
    retention: int | None, boundaries: tuple[int, ...], expected: set[int]
) -> None:
    """The machines' retention oracle on the catalogue vectors 63, 64 (test_retention)."""
    assert kept(16, 16, 1, 0, 16, retention, boundaries) == expected


def test_retention_oracle_wider_window() -> None:
    """67: a 48-token window reads three blocks before each kept boundary."""
    assert kept(16, 16, 3, 0, 16, 0, (255, 96)) == {3, 4, 5, 12, 13, 14}


def test_retention_oracle_in_managers() -> None:
    """60, 44, 49: window 16 at block 16, interval 64, replay 255; [Full 32, SW 8 w 8]
    at alignment 32 with interval 64 (7, 11, 15) and 0 (11)."""
    assert kept(16, 16, 1, 0, 16, 64, (255,)) == {3, 7, 11, 14, 15}
    assert kept(16, 8, 1, 0, 32, 64, (127,)) == {7, 11, 15}
    assert kept(16, 8, 1, 0, 32, 0, (127,)) == {11}


def test_retention_oracle_eagle_shift() -> None:
    """With EAGLE a window group keeps its window and the block after each end: window
    16 at block 16 (2 blocks with EAGLE), dense alignment 32: ends 0, 2, 4, ... keep
    blocks [E - 1, E + 1)."""
    assert kept(8, 16, 2, 1, 32, None, ()) == set(range(8))
    assert kept(8, 16, 2, 1, 64, None, ()) == {0, 3, 4, 7}
