"""Dataset parsing, validation and sharding."""
from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest
import torch

from lowband.app.data import (DEFAULT_DATA_DIR, FILES, DatasetError, ShardedBatches, load_fashion_mnist,
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


# -- python-stdlib: byte windows of the standard library's sources ----------------------------

from lowband.app.data import TEXT_WINDOW, load_python_stdlib, split_of, stdlib_dir, stdlib_files  # noqa: E402


def make_fake_stdlib(root, n_files=40):
    """A tree of small .py files, each holding its own name, plus files that must be skipped."""
    contents = {}
    for i in range(n_files):
        rel = f"pkg{i % 3}/mod{i}.py" if i % 2 else f"mod{i}.py"
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = (f"# file {rel}\n" + f"x_{i} = {i}\n" * (5 + i)).encode()
        open(path, "wb").write(data)
        contents[rel] = data
    for skipped in ("site-packages/third.py", "__pycache__/mod0.py", "notes.txt"):
        os.makedirs(os.path.join(root, os.path.dirname(skipped)), exist_ok=True)
        open(os.path.join(root, skipped), "wb").write(b"must not be read\n" * 50)
    return contents


def test_text_split_is_by_file_and_deterministic(tmp_path):
    contents = make_fake_stdlib(str(tmp_path))
    train = load_python_stdlib("train", str(tmp_path), window=16)
    val = load_python_stdlib("test", str(tmp_path), window=16)
    # every file is in exactly one split, by a hash of its own path, and nothing else is read
    assert sorted(train.files + val.files) == sorted(contents)
    assert not set(train.files) & set(val.files) and val.files and train.files
    assert all(split_of(f) == "train" for f in train.files) and all(split_of(f) == "test" for f in val.files)
    # each split's stream is exactly its files' bytes, concatenated in sorted order
    for split in (train, val):
        assert split.files == sorted(split.files)
        assert bytes(split.stream.tolist()) == b"".join(contents[f] for f in split.files)
    # deterministic: loading again gives the same windows and fingerprint
    again = load_python_stdlib("train", str(tmp_path), window=16)
    assert torch.equal(again.stream, train.stream) and torch.equal(again.starts, train.starts)
    assert again.fingerprint == train.fingerprint != val.fingerprint
    # a changed byte changes the fingerprint
    first = os.path.join(str(tmp_path), train.files[0])
    open(first, "ab").write(b"#")
    assert load_python_stdlib("train", str(tmp_path), window=16).fingerprint != train.fingerprint


def test_text_windows_and_targets(tmp_path):
    make_fake_stdlib(str(tmp_path))
    train = load_python_stdlib("train", str(tmp_path), window=16)
    n = train.stream.numel()
    # train windows tile the stream without overlap; the last one still has its target byte
    assert train.starts.tolist() == list(range(0, n - 16, 16))
    x, y = train.batch(torch.tensor([0, len(train) - 1]))
    assert x.shape == y.shape == (2, 16) and x.dtype == torch.int64
    for row, start in enumerate([0, int(train.starts[-1])]):
        assert x[row].tolist() == train.stream[start:start + 16].tolist()
        assert y[row].tolist() == train.stream[start + 1:start + 17].tolist()   # the next byte
    val = load_python_stdlib("test", str(tmp_path), window=16, validation_windows=5)
    assert len(val) == 5 and val.starts[0] == 0 and val.starts[-1] == val.stream.numel() - 17


def test_text_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_python_stdlib("train", str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(DatasetError, match="fewer than one window"):
        load_python_stdlib("train", str(tmp_path / "empty"))


def test_real_stdlib_corpus():
    files = stdlib_files(stdlib_dir())
    assert len(files) > 100 and "os.py" in files and not any("site-packages" in f for f in files)
    val = load_python_stdlib("test")
    assert len(val) == 128 and val.window == TEXT_WINDOW
    x, _ = val.batch(torch.arange(len(val)))
    assert x.max() < 256 and x.min() >= 0
