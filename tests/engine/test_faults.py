"""A real engine on a remote kvservice when either side dies mid-generation.

An engine SIGKILLed while generating leaves its blocks in the server's pool only until
its session's lease ends; the next engine then generates the stock tokens on that pool.
A server killed while the engine generates makes the engine's next step raise the
integration's error naming the server: every token it produced before is the stock
engine's, and nothing is generated on a local fallback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvservice.bench.server import child_server
from kvservice.client import KVClient
from kvservice.integrations.vllm.engine_driver import (
    SCHEDULER_CLS,
    EngineRun,
    EngineSetup,
    EngineWorkload,
    build_engine,
    drive,
    run_engine,
    shutdown,
)
from kvservice.integrations.vllm.server_link import KVServiceManagerError
from tests.engine.test_generation import server_args
from tests.server.support import wait_for_blocks_back

SETUP = EngineSetup(num_blocks=64)
# Long answers: the engine is still generating when it (or the server) is killed.
LONG = EngineWorkload(3, num_requests=6, max_tokens=(200, 300), arrival_steps=2)

_ENGINE = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import tests.engine  # noqa: F401  (the engine's environment variables)
    from kvservice.integrations.vllm.engine_driver import (
        SCHEDULER_CLS, EngineRun, EngineSetup, build_engine,
    )
    from tests.engine.test_faults import LONG, SETUP
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = build_engine(Path(sys.argv[1]), SETUP, SCHEDULER_CLS, EngineRun())
    for arrival in LONG.arrivals:
        engine.add_request(
            arrival.request_id,
            TokensPrompt(prompt_token_ids=list(arrival.prompt)),
            SamplingParams(temperature=0.0, max_tokens=arrival.max_tokens),
        )
    for step in range(100_000):
        engine.step()
        if step == 10:
            print("generating", flush=True)
    """
)


def test_a_killed_engine_gets_its_blocks_back_within_its_lease(tiny_model: Path) -> None:
    with child_server(server_args(SETUP)) as server, KVClient(server.target) as client:
        env = {
            **os.environ,
            "KVSERVICE_TARGET": server.target,
            "KVSERVICE_SESSION_TTL": "2",
        }
        engine = subprocess.Popen(
            [sys.executable, "-c", _ENGINE, str(tiny_model)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert engine.stdout is not None
            # vLLM logs to stdout too: the engine's own line says it is generating.
            assert "generating" in (line.strip() for line in engine.stdout)
            held = client.get_usage()
            assert held.num_requests > 0 and held.num_used_blocks > 0
            engine.send_signal(signal.SIGKILL)
            engine.wait()
            wait_for_blocks_back(client)
        finally:
            engine.kill()
            engine.wait()
        # The pool serves the next engine as a fresh one.
        os.environ["KVSERVICE_TARGET"] = server.target
        try:
            after = run_engine(tiny_model, LONG, SETUP, SCHEDULER_CLS)
        finally:
            del os.environ["KVSERVICE_TARGET"]
        assert after.outcome() == run_engine(tiny_model, LONG, SETUP).outcome()


def test_a_killed_server_stops_the_engine_naming_it(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stock = run_engine(tiny_model, LONG, SETUP)
    monkeypatch.setenv("KVSERVICE_TIMEOUT", "5")
    with child_server(server_args(SETUP)) as server:
        assert server.pid is not None
        monkeypatch.setenv("KVSERVICE_TARGET", server.target)
        run = EngineRun()
        engine = build_engine(tiny_model, SETUP, SCHEDULER_CLS, run)
        try:
            drive(engine, LONG, run, max_steps=12, stop_early=True)
            assert run.generated_tokens > 0
            os.kill(server.pid, signal.SIGKILL)
            with pytest.raises(KVServiceManagerError, match=f"kvservice at {server.target}"):
                for _ in range(50):
                    engine.step()
        finally:
            shutdown(engine)  # after the failure: no second error at shutdown
    # What the engine produced before the server died is stock vLLM's, token for token.
    for request_id, result in run.requests.items():
        expected = stock.requests[request_id].token_ids
        assert result.token_ids == expected[: len(result.token_ids)]
