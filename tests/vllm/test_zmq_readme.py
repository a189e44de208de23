"""The README's router-side subscriber runs as written against a real server (its
endpoint swapped for the server's free port) and ends with the pool's keys."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from kvservice.client import KVClient
from tests.server.support import tokens
from tests.server.test_readme import python_blocks
from tests.servers import THREAD_TIMEOUT_S, server_in_thread
from tests.vllm.support import ZMQ_POOL, Key, publisher, server_keys

README_ENDPOINT = '"tcp://127.0.0.1:5557"'


def cache(client: KVClient, request_id: str, prompt: list[int]) -> None:
    client.add_request(request_id, prompt)
    assert client.allocate_slots(request_id, len(prompt)) is not None
    client.free(request_id)


def wait_for(condition: Any) -> None:
    """Until ``condition()``; the deadline is only a safety net."""
    deadline = time.monotonic() + THREAD_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "the README's subscriber fell silent"
        time.sleep(0.01)


def seen(scope: dict[str, Any]) -> Counter[Key]:
    """The subscriber's positive counts, read while its thread may be updating them."""
    while True:
        try:
            cached: Counter[Key] = +scope.get("cached", Counter())
            return cached
        except RuntimeError:  # changed size during the copy: read again
            continue


def test_readme_subscriber_follows_a_real_server() -> None:
    (code,) = [b for b in python_blocks() if "KVEventBatch" in b]
    stop = threading.Event()
    # The README loops for ever; here it ends at the first batch after ``stop``.
    code = code.replace("while True:", "while not stop.is_set():")
    with server_in_thread(ZMQ_POOL) as running, KVClient(running.target) as client:
        endpoint = repr(publisher(running.server).endpoint)
        scope: dict[str, Any] = {"__name__": "__readme__", "stop": stop}
        thread = threading.Thread(
            target=exec, args=(code.replace(README_ENDPOINT, endpoint), scope), daemon=True
        )
        thread.start()
        # Its SUB socket joins asynchronously: cache blocks until it has seen some, then
        # reset (AllBlocksCleared: it forgets what it saw) and start from a known state.
        for i in range(10_000):
            cache(client, f"warm-{i}", tokens(16, start=16 * i))
            if seen(scope):
                break
        assert client.reset_prefix_cache()
        wait_for(lambda: not seen(scope))

        for i in range(20):
            cache(client, f"r{i}", tokens(16 * (i % 7 + 1), start=1000 * (i % 3)))
        # Caught up before ``stop``: else the batch that ends its loop may be an earlier
        # one still queued, and it would miss the last request's stores and evictions.
        before: Counter[Key] = running.call(lambda: server_keys(running.server))
        wait_for(lambda: seen(scope) == before)
        stop.set()
        cache(client, "last", tokens(48, start=7))  # the batch that ends its loop
        thread.join(THREAD_TIMEOUT_S)
        assert not thread.is_alive()
        scope["sub"].close(linger=0)
        keys: Counter[Key] = running.call(lambda: server_keys(running.server))
        assert +scope["cached"] == keys and keys
