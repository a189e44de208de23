"""The README's first examples run as written: the in-process manager, and the client
against a server on the embedded default pool (the quick start a new user follows)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from kvservice.server.config import ServerConfig
from tests.server.support import server_in_thread

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


def test_client_quick_start_runs_against_the_embedded_default() -> None:
    (code,) = [b for b in python_blocks() if DEFAULT_TARGET in b]
    # The embedded default pool, on a free port instead of 50051.
    with server_in_thread(ServerConfig(port=0, metrics_port=None)) as running:
        code = code.replace(DEFAULT_TARGET, repr(running.target))
        printed = run(code)
        running.call(running.server.audit)
        # As a person tries it again: it leaves the pool as it found it.
        assert "AdmitStopReason.ALL_ADMITTED" in run(code)
        running.call(running.server.audit)
    assert "AdmitStopReason.ALL_ADMITTED" in printed
