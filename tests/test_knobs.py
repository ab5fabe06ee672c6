"""The knob reference (docs/knobs.md) is generated from the algorithms' dataclass fields and
docstrings: it must match the code, and every option must be documented."""
from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, Optional

from lowband.algorithms import Algorithm
from lowband.app import cli
from lowband.app.knobs import REFERENCE_PATH, docstring_knobs, knob_docs, knob_reference, undocumented

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_knobs_md_is_current():
    with open(os.path.join(ROOT, REFERENCE_PATH)) as f:
        written = f.read()
    assert written == knob_reference(), (f"{REFERENCE_PATH} is out of date with the algorithms' options: "
                                         f"run `lowband knobs --out {REFERENCE_PATH}`")


def test_every_option_of_every_algorithm_is_documented():
    assert undocumented() == [], "options without an entry in their class docstring's Knobs section"


def test_the_command_writes_the_reference(tmp_path, capsys):
    out = tmp_path / "knobs.md"
    assert cli.main(["knobs", "--out", str(out)]) == 0
    assert out.read_text() == knob_reference()
    assert cli.main(["knobs"]) == 0
    assert capsys.readouterr().out == knob_reference()


@dataclasses.dataclass
class _Base(Algorithm):
    """A test algorithm.

    Knobs:
        alpha, beta: two knobs with one text
            that goes on.
        gamma: documented here.

    Prose after the section is not a knob: neither is this.
    """

    alpha: int = 1
    beta: Optional[float] = None
    gamma: str = "g"
    name: ClassVar[str] = "test-base"

    def bind(self, ctx):
        raise NotImplementedError


@dataclasses.dataclass
class _Child(_Base):
    """Knobs (a remark):

        gamma: the child's own text.
    """

    delta: bool = False
    name: ClassVar[str] = "test-child"


def test_entries_are_parsed_and_inherited_along_the_bases():
    assert docstring_knobs(_Base.__doc__) == {"alpha": "two knobs with one text that goes on.",
                                              "beta": "two knobs with one text that goes on.",
                                              "gamma": "documented here."}
    assert knob_docs(_Child) == {"alpha": "two knobs with one text that goes on.",
                                 "beta": "two knobs with one text that goes on.",
                                 "gamma": "the child's own text.", "delta": ""}
    assert undocumented({"test-child": _Child}) == ["test-child.delta"]
    text = knob_reference({"test-child": _Child})
    assert "| `beta` | `Optional[float]` | `None` | two knobs with one text that goes on. |" in text
    assert "| `delta` | `bool` | `False` | (not documented) |" in text
