"""Every script in benchmarks/ imports against the current package, and every runnable one
answers ``--help``: a moved or renamed module breaks this test, not the next person who reruns
a benchmark."""
from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py"))


def _is_script(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


def test_there_are_benchmarks():
    assert len(SCRIPTS) >= 5, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_the_benchmark_imports(path, monkeypatch):
    # as a script, its own directory is first on sys.path (benchmarks share helpers: ranks.py)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"_benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)        # runs the top level only: no main()


@pytest.mark.parametrize("path", [p for p in SCRIPTS if _is_script(p)], ids=lambda p: p.name)
def test_the_benchmark_answers_help(path, monkeypatch, capsys):
    # run as __main__ in this process (torch is imported once for all of them); argparse prints
    # the usage and exits 0 before the script does any work
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(path), run_name="__main__")
    assert exited.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
