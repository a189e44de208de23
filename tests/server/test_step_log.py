"""``StepLog``, the remote-step link's record of a step: what it sends for the
appends, admissions and frees it recorded, whatever order they came in."""

from __future__ import annotations

from kvservice.client.step_log import ANY_ANSWER, StepLog
from kvservice.client.types import AllocateOptions, ComputedBlocks, FreeMode


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


def test_a_one_token_append_that_carries_a_hash_joins_the_column_with_it() -> None:
    """A decode token that completes a client_hashed request's block travels in the
    column, its hash in the column's hashes (counted per entry: none for the entries
    before it); a request's several tokens with a hash still travel alone."""
    log = StepLog()
    log.append_token("b", 2)
    log.append_tokens("a", [1], [b"h" * 32])
    log.append_tokens("c", [3, 4], [b"i" * 32])
    log.append_token("d", 5)
    assert sent_appends(log) == ([("b", 2), ("a", 1), ("d", 5)], [("c", [3, 4], 1)])
    step, _ = log.build()
    column = step.to_pb().ops[0].append_tokens_batch
    assert list(column.num_block_hashes) == [0, 1, 0]
    assert list(column.block_hashes) == [b"h" * 32]
    assert log
    assert not StepLog()


HIT = ComputedBlocks(((3, 4),), 32, 32)
MISS = ComputedBlocks(((),), 0, 0)


def sent_ops(log: StepLog) -> list[tuple[str, list[str]]]:
    """The step's message operations: (kind, the request ids it names)."""
    step, _ = log.build()
    sent: list[tuple[str, list[str]]] = []
    for op in step.to_pb().ops:
        kind = op.WhichOneof("op")
        assert kind is not None
        body = getattr(op, kind)
        names = list(body.request_ids) if hasattr(body, "request_ids") else [body.request_id]
        sent.append((kind, names))
    return sent


def test_admissions_travel_as_one_column_of_lookups_and_allocations() -> None:
    """Each waiting request's lookup and the allocation right after it that attaches
    its hit (or none, for a miss) join one lookup_allocate_batch, in order; the plain
    allocations of running requests before them keep their own column."""
    log = StepLog()
    log.allocate("run", 1, ((),))
    log.lookup("a", HIT)
    log.allocate("a", 8, ((5,),), hit=HIT)
    log.lookup("b", MISS)
    log.allocate("b", 40, None)
    assert sent_ops(log) == [
        ("allocate_slots_batch", ["run"]),
        ("lookup_allocate_batch", ["a", "b"]),
    ]


def test_a_lookup_whose_allocation_does_not_attach_it_travels_alone() -> None:
    """A lookup with no allocation after it, one followed by another request's
    allocation, a hit the allocation attaches otherwise, and a hit left unattached:
    each lookup and allocation is sent as itself."""
    log = StepLog()
    log.lookup("a", HIT)  # never allocated (no budget left, say)
    log.lookup("b", HIT)
    log.allocate("c", 1, ((),))
    log.lookup("d", HIT)
    log.allocate("d", 8, ((5,),), hit=ComputedBlocks(((3,),), 16, 16))
    log.lookup("e", HIT)
    log.allocate("e", 8, ((6,),))
    assert [kind for kind, _ in sent_ops(log)] == [
        "get_computed_blocks",
        "get_computed_blocks",
        "allocate_slots_batch",
        "get_computed_blocks",
        "allocate_slots",
        "get_computed_blocks",
        "allocate_slots_batch",
    ]


def test_frees_travel_as_one_column_keeping_blocks_where_asked() -> None:
    log = StepLog()
    log.free("a", FreeMode.FINISH)
    log.free("b", FreeMode.PREEMPT, keep_blocks=True)
    log.record("new_step_starts", (), ANY_ANSWER)
    log.free("c", FreeMode.FINISH)
    step, _ = log.build()
    first, boundary, last = step.to_pb().ops
    assert list(first.free_batch.request_ids) == ["a", "b"]
    assert list(first.free_batch.keep_blocks) == [False, True]
    assert boundary.WhichOneof("op") == "new_step_starts"
    assert list(last.free_batch.request_ids) == ["c"]
    assert list(last.free_batch.keep_blocks) == []


def test_admissions_join_a_column_only_with_the_same_options() -> None:
    """vLLM admits with options (its default reserves the full prompt): entries with
    the same options share a batch, other options open another, and options a batch
    cannot carry (a connector's external tokens) send the lookup and the allocation
    as themselves."""
    reserve = AllocateOptions(full_sequence_must_fit=True)
    log = StepLog()
    for request_id, options in (("a", reserve), ("b", reserve), ("c", None)):
        log.lookup(request_id, MISS)
        log.allocate(request_id, 8, ((5,),), options=options)
    log.lookup("d", MISS)
    log.allocate("d", 8, ((6,),), options=AllocateOptions(num_external_computed_tokens=16))
    assert sent_ops(log) == [
        ("lookup_allocate_batch", ["a", "b"]),
        ("lookup_allocate_batch", ["c"]),
        ("get_computed_blocks", ["d"]),
        ("allocate_slots", ["d"]),
    ]


def test_plain_new_requests_travel_as_one_column_in_order() -> None:
    """New requests with nothing but a prompt share an add_request_batch, those with
    vLLM's hashes one of their own; a request with any other argument (a salt) travels
    alone, in its place; every new request goes before the step's other operations."""
    log = StepLog()
    log.free("done", FreeMode.FINISH)
    log.add_request("a", [1, 2, 3], cache_salt=None, lora_name=None, mm_features=[])
    log.add_request("b", [4])
    log.add_request("salted", [5], cache_salt="s")
    log.add_request("c", [6])
    log.add_request("hashed", [7] * 16, block_hashes=[b"h" * 32])
    log.add_request("short", [8], block_hashes=[])
    step, expected = log.build()
    assert sent_ops(log) == [
        ("add_request_batch", ["a", "b"]),
        ("add_request", ["salted"]),
        ("add_request_batch", ["c"]),
        ("add_request_batch", ["hashed", "short"]),
        ("free_batch", ["done"]),
    ]
    ops = step.to_pb().ops
    first, hashed = ops[0].add_request_batch, ops[3].add_request_batch
    assert list(first.num_prompt_tokens) == [3, 1] and not first.client_hashed
    assert list(hashed.num_block_hashes) == [1, 0] and hashed.client_hashed
    assert [type(item).__name__ for item in expected[:3]] == ["AddRequestRun"] * 3


def test_a_prompt_that_does_not_pack_sends_its_run_as_single_requests() -> None:
    """A token id outside 4 unsigned bytes cannot travel packed: the run goes as
    single AddRequests, which send it as given for the server to name."""
    log = StepLog()
    log.add_request("a", [1])
    log.add_request("b", [-1])
    assert sent_ops(log) == [("add_request", ["a"]), ("add_request", ["b"])]
    _, expected = log.build()
    assert expected == []
