"""The trained-row counts of ``cp-diloco``'s ``sparse_rows``: the packed flags against a plain
count whatever the ranks' number and the collective's way of averaging, the tables chosen, and
the per-row scaling against a loop."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lowband.algorithms.sparse_rows import (MAX_WORLD, RowCounter, pack_flags, packed_width, row_tables,
                                            rows_per_value, unpack_counts)
from lowband.app.models import make_model


@settings(max_examples=40, deadline=None)
@given(world=st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16, 63, 64, 100, 1024, MAX_WORLD]),
       rows=st.integers(1, 300), p=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       premultiplied=st.booleans())
def test_packed_flags_give_the_exact_counts(world, rows, p, seed, premultiplied):
    """The ranks' fp32 mean of their packed flags, summed in rank order then divided (gloo,
    lowband's own average) or pre-scaled by 1/N then summed (NCCL's average), unpacks to
    each row's count of ranks; the width is what :func:`packed_width` says."""
    g = torch.Generator().manual_seed(seed)
    ranks = min(world, 8)                  # the ranks that flag anything; the rest send zeros
    flags = [torch.rand(rows, generator=g) < p for _ in range(ranks)]
    packed = [pack_flags(f, world) for f in flags]
    assert all(x.dtype == torch.float32 and x.numel() == packed_width(rows, world) for x in packed)
    packed += [torch.zeros_like(packed[0])] * (world - ranks)
    if world > ranks and ranks:          # the ranks with flags set everywhere may be many: all of them
        packed[-1] = pack_flags(torch.ones(rows, dtype=torch.bool), world)
        flags.append(torch.ones(rows, dtype=torch.bool))
    if premultiplied:
        mean = torch.zeros_like(packed[0])
        for x in packed:
            mean += x * torch.tensor(1.0 / world, dtype=torch.float32)
    else:
        total = torch.zeros_like(packed[0])
        for x in packed:
            total += x
        mean = total / world
    want = sum(f.long() for f in flags)
    assert torch.equal(unpack_counts(mean, world, rows), want)


@pytest.mark.parametrize("world", [3, 7, 100, 1000, MAX_WORLD])
def test_every_rank_flagging_every_row_is_counted_exactly(world):
    """The largest packed sums (every field at N) survive both ways of averaging in fp32."""
    packed = pack_flags(torch.ones(50, dtype=torch.bool), world)
    scaled, total = torch.zeros_like(packed), torch.zeros_like(packed)
    inverse = torch.tensor(1.0 / world, dtype=torch.float32)
    for _ in range(world):
        scaled += packed * inverse
        total += packed
    for mean in (scaled, total / world):
        assert torch.equal(unpack_counts(mean, world, 50), torch.full((50,), world, dtype=torch.int64))


def test_rows_per_value_shrinks_with_the_world():
    assert [rows_per_value(n) for n in (1, 2, 4, 8, 64, MAX_WORLD)] == [21, 10, 6, 4, 2, 1]
    with pytest.raises(ValueError, match=f"up to {MAX_WORLD} ranks"):
        RowCounter([nn.Embedding(4, 2).weight], [(0, 0)], MAX_WORLD + 1)


def test_row_tables_are_untied_embedding_weights():
    """gpt-ngram: its n-gram tables and position table; gpt: not the token table tied to the
    output head; no Linear or bias."""
    for name, want in [("gpt-ngram", ["pos.weight", "ngrams.0.weight", "ngrams.1.weight"]), ("gpt", ["pos.weight"]),
                       ("cnn", [])]:
        model = make_model(name)
        params = list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        assert [names[i] for i in row_tables(model, params, list(range(len(params))))] == want, name


def test_counter_flags_dense_and_sparse_gradients_and_scales_rows():
    """Rows with a non-zero gradient in any observed step are flagged (a sparse table's too);
    ``take`` packs and resets; ``scale_`` multiplies each flagged row by N / count and leaves
    rows no rank trained, and everything outside the tables, as they are."""
    dense, sparse = nn.Embedding(5, 3), nn.Embedding(4, 2, sparse=True)
    other = nn.Parameter(torch.zeros(2))
    params = [other, dense.weight, sparse.weight]
    counter = RowCounter(params, [(1, 2), (2, 2 + 15)], world=4)
    dense(torch.tensor([1, 3])).sum().backward()
    counter.observe()
    dense.weight.grad = None
    dense(torch.tensor([4])).sum().backward()
    sparse(torch.tensor([2, 2])).sum().backward()
    counter.observe()
    assert counter.flags.tolist() == [False, True, False, True, True] + [False, False, True, False]
    mine = counter.take(reset=False)
    assert counter.flags.any()
    other_rank = pack_flags(torch.tensor([0, 1, 1, 0, 0] + [0, 0, 1, 1], dtype=torch.bool), 4)
    mean = (counter.take() + other_rank + 0 * mine + 0 * mine) / 4    # two ranks flagged nothing
    assert not counter.flags.any()
    average = torch.arange(2 + 15 + 8, dtype=torch.float32)
    want = average.clone()
    counts = [0, 2, 1, 1, 1] + [0, 0, 2, 1]
    for row, c in enumerate(counts):
        start = 2 + 3 * row if row < 5 else 2 + 15 + 2 * (row - 5)
        width = 3 if row < 5 else 2
        if c:
            want[start:start + width] *= 4 / c
    assert torch.equal(counter.scale_(average, mean), want)
