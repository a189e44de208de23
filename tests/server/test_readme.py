"""The README's Python examples run as written, and again (a person tries twice): the
in-process manager, the client quick start, the sessions example and the KV event
subscriber, each against a server on the embedded default pool."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from kvservice.server.config import ServerConfig
from tests.servers import server_in_thread

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_TARGET = '"127.0.0.1:50051"'


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def run(code: str) -> str:
    """Execute ``code`` as a script and return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    return out.getvalue()


def test_in_process_example_runs() -> None:
    (code,) = [b for b in python_blocks() if "KVCacheManager(" in b]
    run(code)


def block(marker: str) -> str:
    """The one Python block of the README containing ``marker``."""
    (code,) = [b for b in python_blocks() if marker in b]
    return code


def test_client_quick_start_runs_against_the_embedded_default() -> None:
    code = block("StepBuilder()")
    # The embedded default pool, on a free port instead of 50051.
    with server_in_thread(ServerConfig(port=0, metrics_port=None)) as running:
        code = code.replace(DEFAULT_TARGET, repr(running.target))
        printed = run(code)
        running.call(running.server.audit)
        # As a person tries it again: it leaves the pool as it found it.
        assert "AdmitStopReason.ALL_ADMITTED" in run(code)
        running.call(running.server.audit)
    assert "AdmitStopReason.ALL_ADMITTED" in printed


def test_the_sessions_example_runs_twice() -> None:
    code = block("open_session(")
    with server_in_thread(ServerConfig(port=0, metrics_port=None)) as running:
        code = code.replace(DEFAULT_TARGET, repr(running.target))
        for _ in range(2):  # the lease's close freed what the first run added
            assert "Allocation(" in run(code)
            running.call(running.server.audit)


def test_the_kv_event_subscriber_runs() -> None:
    """The subscriber's loop runs until stopped: cut after the snapshot it starts with."""
    code = block("CachedBlocksView()")
    printing = "        print(view.sequence, len(view.counts))"
    assert printing in code
    code = code.replace(printing, printing + "\n        break")
    config = ServerConfig(port=0, metrics_port=None, kv_events=True)
    with server_in_thread(config) as running:
        code = code.replace(DEFAULT_TARGET, repr(running.target))
        assert run(code).split() == ["0", "0"]  # an empty pool: nothing cached yet
