"""The committed generated code is what ``make proto`` produces from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "kvservice" / "protocol" / "gen"


def _files(directory: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.suffix in {".py", ".pyi"}
    }


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    """Regenerating into a temporary directory gives byte-identical files; if this
    fails, run ``make proto`` and commit the result."""
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    fresh, committed = _files(tmp_path), _files(GENERATED)
    assert sorted(fresh) == sorted(committed)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run `make proto`"


def test_generated_imports_are_package_absolute() -> None:
    """No generated module imports the proto path (``kvservice.v1``), which is not a
    Python package."""
    for name, text in _files(GENERATED).items():
        assert "from kvservice.v1 import" not in text.decode(), name
        assert "import kvservice.v1" not in text.decode(), name
