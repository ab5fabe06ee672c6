"""ruff is clean on src, tests, benchmarks and examples ([tool.ruff] in pyproject.toml). Skipped where ruff
is not installed (it is in the ``test`` extra)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")        # the venv's, when pytest runs from it
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [found]


def test_ruff_is_clean():
    out = subprocess.run([*_ruff(), "check", "--no-cache", "src", "tests", "benchmarks", "examples"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
