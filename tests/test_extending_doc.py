"""docs/extending.md's code runs as written: every ```python block whose first line is
``# test: run`` is saved as a script and run in a fresh interpreter from a directory outside the
repository (so it sees lowband only as an installed package, as a user's script would)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
MARK = "# test: run"
#: the blocks the doc is expected to hold: the codec and the algorithm examples
EXPECTED_BLOCKS = 2


def runnable_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of ``text`` whose first line is the marker, verbatim."""
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return [b for b in blocks if b.splitlines() and b.splitlines()[0].strip() == MARK]


def test_extraction_finds_only_marked_blocks():
    text = "```python\n# test: run\nprint(1)\n```\n\n```python\nprint(2)\n```\n```\n# test: run\n```\n"
    assert runnable_blocks(text) == ["# test: run\nprint(1)\n"]


def test_the_doc_has_its_runnable_blocks():
    assert len(runnable_blocks(DOC.read_text())) == EXPECTED_BLOCKS


@pytest.mark.parametrize("index", range(EXPECTED_BLOCKS))
def test_block_runs_from_outside_the_package(index, tmp_path):
    code = runnable_blocks(DOC.read_text())[index]
    script = tmp_path / f"extending_{index}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, f"block {index} of {DOC.name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
