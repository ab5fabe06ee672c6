"""Dataset parsing, validation and sharding."""
from __future__ import annotations

import gzip
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from lowband.data import (DEFAULT_DATA_DIR, FILES, DatasetError, ShardedBatches, load_fashion_mnist,
                          make_synthetic)


def write_idx(path, array: np.ndarray, magic: int, declared_dims=None):
    dims = declared_dims or array.shape
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + struct.pack(">" + "I" * len(dims), *dims) + array.astype(np.uint8).tobytes())


def make_fake_dataset(directory, n=20, **overrides):
    rng = np.random.default_rng(0)
    for split, (img, lbl) in FILES.items():
        write_idx(os.path.join(directory, img), rng.integers(0, 256, (n, 28, 28)), 0x803)
        write_idx(os.path.join(directory, lbl), rng.integers(0, 10, (n,)), 0x801)
    return directory


def test_reads_valid_idx(tmp_path):
    d = make_fake_dataset(tmp_path)
    ds = load_fashion_mnist(str(d), "train")
    assert ds.images.shape == (20, 1, 28, 28) and ds.labels.shape == (20,)
    assert ds.images.dtype == torch.float32 and ds.labels.dtype == torch.int64


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="missing"):
        load_fashion_mnist(str(tmp_path), "train")


def test_truncated_gzip(tmp_path):
    d = make_fake_dataset(tmp_path)
    path = os.path.join(d, FILES["train"][0])
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="corrupt or truncated"):
        load_fashion_mnist(str(d), "train")


def test_size_disagrees_with_header(tmp_path):
    d = make_fake_dataset(tmp_path)
    write_idx(os.path.join(d, FILES["train"][0]), np.zeros((20, 28, 28)), 0x803, declared_dims=(21, 28, 28))
    with pytest.raises(DatasetError, match="header"):
        load_fashion_mnist(str(d), "train")


def test_wrong_magic(tmp_path):
    d = make_fake_dataset(tmp_path)
    write_idx(os.path.join(d, FILES["train"][1]), np.zeros((20,)), 0x803, declared_dims=(20,))
    with pytest.raises(DatasetError, match="magic"):
        load_fashion_mnist(str(d), "train")


def test_label_count_mismatch(tmp_path):
    d = make_fake_dataset(tmp_path)
    write_idx(os.path.join(d, FILES["train"][1]), np.zeros((19,)), 0x801)
    with pytest.raises(DatasetError, match="labels"):
        load_fashion_mnist(str(d), "train")


@pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_DATA_DIR, FILES["test"][0])),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_test_split():
    ds = load_fashion_mnist(DEFAULT_DATA_DIR, "test")
    assert len(ds) == 10000
    assert torch.bincount(ds.labels).tolist() == [1000] * 10


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharding_each_sample_at_most_once_and_same_global_batch(world):
    data = make_synthetic(100, seed=0)
    local = 6
    shards = [ShardedBatches(data, local, r, world, seed=5) for r in range(world)]
    single = ShardedBatches(data, local * world, 0, 1, seed=5)
    steps = shards[0].steps_per_epoch
    assert steps == 100 // (local * world)
    seen = []
    for s in range(steps):
        parts = [sh.indices(1, s) for sh in shards]
        assert all(p.numel() == local for p in parts)
        assert torch.equal(torch.cat(parts), single.indices(1, s))   # same global batch for any world size
        seen.extend(torch.cat(parts).tolist())
    assert len(seen) == len(set(seen))                                  # no sample twice in an epoch
    assert not torch.equal(shards[0].indices(0, 0), shards[0].indices(1, 0))   # reshuffled per epoch


def test_sharding_rejects_bad_sizes():
    data = make_synthetic(10)
    with pytest.raises(ValueError, match="positive"):
        ShardedBatches(data, 0, 0, 1)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        ShardedBatches(data, 8, 0, 2)


def test_synthetic_is_deterministic_and_learnable_shape():
    a, b = make_synthetic(50, seed=3), make_synthetic(50, seed=3)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert a.images.shape == (50, 1, 28, 28)
