"""benchmarks/codecs.py, the bench issue 8's codec clauses are read from, still runs: its bucket
table (with its two yardsticks, ``clone`` and ``copy_`` into a kept buffer) and its A/B mode, on
inputs small enough to take a second."""
from __future__ import annotations

import importlib.util
import os

import pytest

from lowband import _native as kernels

# loaded from its path: on sys.path its name would shadow the standard library's codecs
_spec = importlib.util.spec_from_file_location(
    "lowband_codecs_bench",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "codecs.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _rows(table: str, label: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith(f"| {label}")]


def test_bucket_table_has_both_yardsticks_and_every_codec():
    table = bench.run_buckets([3000], ["cnn"], [2, 32], reps=1)
    flat = _rows(table, "3,000 elements")
    assert [r[2] for r in flat] == ["torch.clone", "copy_ (no alloc)"] + [t for t, _, _ in bench.BUCKET_CODECS]
    buckets = _rows(table, "cnn buckets")
    assert [r[2] for r in buckets[:2]] == ["torch.clone", "copy_ (no alloc)"]
    assert [(r[1], r[2]) for r in buckets[2:]] == [(f"two-stage, N={n}", t) for n in (2, 32)
                                                 for t, _, _ in bench.BUCKET_CODECS]
    clone = float(buckets[0][3])
    for row in buckets[1:]:
        assert float(row[3]) > 0 and float(row[4]) == pytest.approx(float(row[3]) / clone, rel=0.03, abs=0.006)  # 2-decimal cells


def test_ab_mode_compares_a_build_with_itself():
    lib = kernels.library()
    if lib is None:
        pytest.skip(f"native kernels missing: {kernels.unavailable_reason()}")
    path = lib._name
    table = bench.run_ab([path, path], [3000], [], [2], reps=1, rounds=1)
    rows = _rows(table, "3,000 elements")
    assert [r[2] for r in rows] == [t for t, _, _ in bench.BUCKET_CODECS]
    for row in rows:
        assert float(row[5]) > 0 and float(row[8]) > 0   # B / A of encode and of decode
