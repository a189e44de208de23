"""``StepLog``, the remote-step link's record of a step: what it sends for the
appends it recorded, whatever order they came in."""

from __future__ import annotations

from kvservice.client.step_log import StepLog


def sent_appends(log: StepLog) -> tuple[list[tuple[str, int]], list[tuple[str, list[int], int]]]:
    """(the columnar batch's (request, token) entries, the single appends' (request,
    tokens, number of hashes)) of the step ``log`` builds."""
    step, _ = log.build()
    batch: list[tuple[str, int]] = []
    single: list[tuple[str, list[int], int]] = []
    for op in step.to_pb().ops:
        kind = op.WhichOneof("op")
        if kind == "append_tokens_batch":
            column = op.append_tokens_batch
            batch.extend(zip(column.request_ids, column.token_ids, strict=True))
        elif kind == "append_tokens":
            append = op.append_tokens
            single.append((append.request_id, list(append.token_ids), len(append.block_hashes)))
    return batch, single


def test_one_token_appends_travel_as_one_column() -> None:
    log = StepLog()
    log.append_token("a", 1)
    log.append_tokens("b", [2])
    assert sent_appends(log) == ([("a", 1), ("b", 2)], [])


def test_a_second_append_of_the_step_joins_the_first_in_order() -> None:
    """A request that appends twice in a step leaves the column and sends its tokens
    in the order they came, with any hash among them."""
    log = StepLog()
    log.append_token("a", 1)
    log.append_token("b", 2)
    log.append_token("a", 3)
    log.append_tokens("b", [4, 5])
    log.append_tokens("c", [6], [b"h" * 32])
    log.append_token("c", 7)
    batch, single = sent_appends(log)
    assert batch == []
    assert sorted(single) == [("a", [1, 3], 0), ("b", [2, 4, 5], 0), ("c", [6, 7], 1)]


def test_an_append_that_carries_a_hash_travels_alone() -> None:
    log = StepLog()
    log.append_tokens("a", [1], [b"h" * 32])
    log.append_token("b", 2)
    assert sent_appends(log) == ([("b", 2)], [("a", [1], 1)])
    assert log
    assert not StepLog()
