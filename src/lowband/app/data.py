"""Datasets as in-memory tensors, and deterministic per-rank sharding.

Fashion-MNIST is read from its gzipped IDX files (the layout of Debian's
``dataset-fashion-mnist`` package). Every header and size is validated, so a missing,
truncated or corrupt file gives one clear :class:`DatasetError` instead of a wrong model.

``python-stdlib`` is real text every machine has without a download: the ``*.py`` source files
of the running Python's standard library, as byte-level windows for a language model (see
:func:`load_python_stdlib`).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import struct
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
DEBIAN_PACKAGE = "dataset-fashion-mnist"
IDX_IMAGES_MAGIC = 0x00000803   # unsigned byte, 3 dimensions
IDX_LABELS_MAGIC = 0x00000801   # unsigned byte, 1 dimension
NUM_CLASSES = 10
IMAGE_SIDE = 28
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# Per-pixel statistics of the Fashion-MNIST training set (computed once from the data).
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530


class DatasetError(Exception):
    """A dataset file is missing, unreadable, truncated or inconsistent."""


@dataclass
class TensorDataset:
    images: torch.Tensor   # float32 [n, 1, 28, 28], normalised
    labels: torch.Tensor   # int64 [n]

    def __len__(self) -> int:
        return self.labels.numel()

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[idx], self.labels[idx]


def _read_gz(path: str) -> bytes:
    if not os.path.exists(path):
        raise DatasetError(f"dataset file {path} is missing (install the Debian package "
                           f"'{DEBIAN_PACKAGE}' or pass --data-dir)")
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"dataset file {path} is corrupt or truncated: {e}") from None


def _parse_idx(path: str, magic: int, ndim: int) -> np.ndarray:
    raw = _read_gz(path)
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"dataset file {path} is truncated: {len(raw)} bytes, shorter than its IDX header")
    found = struct.unpack(">I", raw[:4])[0]
    if found != magic:
        raise DatasetError(f"dataset file {path} is not an IDX file of the expected kind "
                           f"(magic 0x{found:08x}, expected 0x{magic:08x})")
    dims = struct.unpack(">" + "I" * ndim, raw[4:header])
    expected = int(np.prod(dims))
    if len(raw) - header != expected:
        raise DatasetError(f"dataset file {path} has {len(raw) - header} data bytes but its header "
                           f"declares {'x'.join(map(str, dims))} = {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load_fashion_mnist(data_dir: str = DEFAULT_DATA_DIR, split: str = "train") -> TensorDataset:
    """Load and validate one split ("train" or "test")."""
    img_name, lbl_name = FILES[split]
    images = _parse_idx(os.path.join(data_dir, img_name), IDX_IMAGES_MAGIC, 3)
    labels = _parse_idx(os.path.join(data_dir, lbl_name), IDX_LABELS_MAGIC, 1)
    if images.shape[1:] != (IMAGE_SIDE, IMAGE_SIDE):
        raise DatasetError(f"{img_name}: images are {images.shape[1]}x{images.shape[2]}, expected 28x28")
    if images.shape[0] != labels.shape[0]:
        raise DatasetError(f"{data_dir}: {images.shape[0]} images but {labels.shape[0]} labels in split {split!r}")
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise DatasetError(f"{lbl_name}: label {int(labels.max())} outside 0..{NUM_CLASSES - 1}")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - FASHION_MEAN) / FASHION_STD
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def make_synthetic(n: int, seed: int = 0, noise: float = 1.0) -> TensorDataset:
    """A learnable stand-in with Fashion-MNIST's shapes: each class is a fixed random
    prototype image plus Gaussian noise. Deterministic in ``seed``; for tests."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(NUM_CLASSES, 1, IMAGE_SIDE, IMAGE_SIDE, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    images = prototypes[labels] + noise * torch.randn(n, 1, IMAGE_SIDE, IMAGE_SIDE, generator=g)
    return TensorDataset(images, labels)


# -- text: the Python standard library's sources as byte windows ----------------------------

#: bytes per window: the model sees ``TEXT_WINDOW`` bytes and predicts each one's successor
TEXT_WINDOW = 128
#: one file in VALIDATION_MODULUS goes to validation, chosen by a hash of its relative path
#: (so a file's split does not depend on which other files a Python version ships)
VALIDATION_MODULUS = 10
#: windows scored per evaluation: evenly spaced over the validation text. 128 x 128 bytes =
#: 16 KiB, a forward pass of about three training steps' worth of work on the default batch.
VALIDATION_WINDOWS = 128
#: directories of the stdlib tree that are not the standard library
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass
class TextWindows:
    """Fixed-length byte windows of one text stream. Window ``i`` starts at ``starts[i]``;
    its input is ``window`` bytes and its target the same bytes shifted by one."""

    stream: torch.Tensor      # uint8 [n_bytes], the split's files concatenated in sorted order
    starts: torch.Tensor      # int64 [n_windows]
    window: int
    files: list[str]          # the split's files, relative to the stdlib directory, sorted
    fingerprint: str          # sha256 over every file's relative path and bytes (first 16 hex digits)

    def __len__(self) -> int:
        return self.starts.numel()

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = self.starts[idx].unsqueeze(1) + torch.arange(self.window + 1)
        w = self.stream[offsets].long()
        return w[:, :-1], w[:, 1:]


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[str]:
    """Every ``*.py`` file under ``root`` (relative, '/'-separated, sorted), skipping
    site-packages and caches."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(found)


def split_of(relpath: str) -> str:
    """"test" (validation) or "train" for one file, from a hash of its relative path."""
    return "test" if zlib.crc32(relpath.encode()) % VALIDATION_MODULUS == 0 else "train"


def load_python_stdlib(split: str = "train", root: Optional[str] = None, window: int = TEXT_WINDOW,
                       validation_windows: int = VALIDATION_WINDOWS) -> TextWindows:
    """The standard library's sources of the running Python as byte windows, split into
    train and validation ("test") by file. Train windows tile the train text (stride
    ``window``); the validation split is ``validation_windows`` windows evenly spaced over the
    validation text, the same ones at every evaluation. Deterministic for a given Python
    installation; ``fingerprint`` names it."""
    root = root or stdlib_dir()
    if not os.path.isdir(root):
        raise DatasetError(f"the Python standard library directory {root} does not exist")
    files = [f for f in stdlib_files(root) if split_of(f) == split]
    digest = hashlib.sha256()
    chunks = []
    for rel in files:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
        except OSError as e:
            raise DatasetError(f"cannot read {os.path.join(root, rel)}: {e}") from None
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        chunks.append(data)
    raw = b"".join(chunks)
    if len(raw) < window + 1:
        raise DatasetError(f"the {split} split of {root} holds {len(raw)} bytes of Python source, "
                           f"fewer than one window of {window + 1}")
    stream = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    last = len(raw) - window - 1       # the last start with a full window and its target
    if split == "train":
        starts = torch.arange(0, last + 1, window, dtype=torch.int64)
    else:
        starts = torch.linspace(0, last, min(validation_windows, last + 1), dtype=torch.float64).round().long()
    return TextWindows(stream, starts, window, files, digest.hexdigest()[:16])


IMAGE_DATASETS = ("fashion-mnist", "synthetic")
#: datasets of byte windows, for language models
TEXT_DATASETS = ("python-stdlib",)
DATASETS = IMAGE_DATASETS + TEXT_DATASETS
SYNTHETIC_SIZES = {"train": 8192, "test": 2048}


def load_dataset(name: str, split: str, data_dir: str = DEFAULT_DATA_DIR,
                 seed: int = 0) -> "TensorDataset | TextWindows":
    if name == "python-stdlib":
        return load_python_stdlib(split)
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir, split)
    if name == "synthetic":
        # train and test share prototypes (same seed) but not samples
        full = make_synthetic(SYNTHETIC_SIZES["train"] + SYNTHETIC_SIZES["test"], seed=seed)
        cut = SYNTHETIC_SIZES["train"]
        sl = slice(0, cut) if split == "train" else slice(cut, None)
        return TensorDataset(full.images[sl], full.labels[sl])
    raise DatasetError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")


class ShardedBatches:
    """Deterministic data-parallel batching.

    Each epoch draws one permutation from ``(seed, epoch)``, cuts it into global batches of
    ``world_size * batch_size`` samples, and gives rank r the r-th slice of each. Every sample is
    used at most once per epoch; the incomplete last global batch (fewer than
    ``world_size * batch_size`` samples) is dropped so every rank takes the same number of steps
    (unequal step counts would deadlock the collectives). The shuffle rotates which samples are
    dropped. The global batch of step s is the same for any ``world_size`` with the same
    ``world_size * batch_size``, which is what the equivalence tests rely on.
    """

    def __init__(self, dataset: "TensorDataset | TextWindows", batch_size: int, rank: int, world_size: int, seed: int = 0):
        if batch_size <= 0:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        self.dataset, self.batch_size, self.rank, self.world_size, self.seed = dataset, batch_size, rank, world_size, seed
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = len(dataset) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"dataset of {len(dataset)} samples is smaller than one global batch "
                             f"({world_size} workers x {batch_size})")

    def indices(self, epoch: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.dataset), generator=g)
        start = step * self.global_batch + self.rank * self.batch_size
        return perm[start:start + self.batch_size]

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.dataset), generator=g)
        for step in range(start_step, self.steps_per_epoch):
            start = step * self.global_batch + self.rank * self.batch_size
            yield self.dataset.batch(perm[start:start + self.batch_size])
