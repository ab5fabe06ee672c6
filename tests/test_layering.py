"""Import layering of src/lowband: a lower layer never imports a higher one.

The order is written once, here (:data:`LAYERS`), and explained in docs/architecture.md. Every
``import`` and ``from ... import`` in the package (including those inside functions and under
``TYPE_CHECKING``) is resolved to the lowband module it names and checked against it. A module may
import its own layer and any layer below it.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lowband"

#: lowest first; the packages of one layer may import each other. ``lowband`` is the public API
#: (lowband/__init__.py): only the app, perf and nothing in the library import it.
LAYERS: list[tuple[str, ...]] = [
    ("runtime", "netem"),                 # the worker process and emulated links: import nothing of lowband
    ("_native",),                         # C kernels and their loader, Triton kernels
    ("codecs",),                          # one file per codec, error feedback, bucket layout and dispatch
    ("comm",),                            # communicator, wire bytes, ordered queue, compressed reducer, plans
    ("optim",),                           # tentative and fused optimizer steps
    ("algorithms",),                      # what to send when: one file per method, peers/
    ("engine", "integrations"),           # the Engine and its guard; the DDP comm hook
    ("lowband",),                         # the public API in lowband/__init__.py
    ("app", "perf"),                      # cli, train loop, bench, report; performance model and planner
]

#: known exceptions: (importing module, imported module) -> reason. Keep this short.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def rank_of(module: str) -> int:
    """The layer index of a lowband module (``lowband.comm.pipeline`` -> comm's)."""
    parts = module.split(".")
    assert parts[0] == "lowband", module
    key = parts[1] if len(parts) > 1 else "lowband"
    for i, layer in enumerate(LAYERS):
        if key in layer:
            return i
    raise AssertionError(f"{module}: its package {key!r} is in no layer of LAYERS (add it there and to "
                         f"docs/architecture.md)")


def _is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, imported lowband module) for every import in ``source``, the text of ``module``."""
    package = module if is_package else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "lowband" or alias.name.startswith("lowband."):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                target: Optional[str] = ".".join(base) + ("." + node.module if node.module else "")
            else:
                target = node.module
            if target is None or not (target == "lowband" or target.startswith("lowband.")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if _is_module(sub) else target


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import in ``source`` (the text of ``module``) of a higher layer, as one line."""
    own = rank_of(module)
    out = []
    for line, target in imports_of(source, module, is_package):
        if rank_of(target) > own and (module, target) not in EXCEPTIONS:
            out.append(f"{module}:{line} imports {target} (layer {LAYERS[rank_of(target)]} is above "
                       f"{LAYERS[own]})")
    return out


def package_modules() -> Iterator[tuple[str, Path, bool]]:
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), path, is_package


def test_no_lower_layer_imports_a_higher_one():
    found = [v for module, path, is_package in package_modules()
             for v in violations(path.read_text(), module, is_package)]
    assert not found, "\n".join(found)


def test_the_check_fails_on_an_inverted_import():
    # a codec that reaches up into the engine, written three ways
    assert violations("from ..engine.guard import GradientGuard\n", "lowband.codecs.topk")
    assert violations("def f():\n    import lowband.algorithms\n", "lowband.codecs.topk")
    assert violations("from .. import app\n", "lowband.comm", is_package=True)
    # the library may not import the public API either
    assert violations("from lowband import distribute\n", "lowband.algorithms.ssgd")
    # downward and same-layer imports pass
    assert not violations("from ..comm.wire import MIB\nfrom .base import Algorithm\n", "lowband.algorithms.ssgd")
    assert not violations("from ..perf.profile import measure\nfrom ..codecs import COMPRESSORS\n",
                          "lowband.app.cli")


def test_the_exceptions_are_still_needed():
    current = {(module, target) for module, path, is_package in package_modules()
               for _, target in imports_of(path.read_text(), module, is_package)}
    stale = [f"{a} -> {b}" for a, b in EXCEPTIONS if (a, b) not in current]
    assert not stale, "known exceptions that no longer occur (remove them): " + ", ".join(stale)


@pytest.mark.parametrize("module", ["lowband.netem.cluster", "lowband.perf.model", "lowband.app.cli", "lowband"])
def test_every_package_has_a_layer(module):
    rank_of(module)


def test_the_top_level_holds_at_most_eight_modules():
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= 8, top
    for child in SRC.iterdir():
        if child.is_dir() and (child / "__init__.py").exists():
            rank_of(f"lowband.{child.name}")
