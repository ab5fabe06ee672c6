"""What a model is trained to do: the loss, the held-out metrics, and the defaults that suit it.

Two tasks, told apart by the model's name:

* ``classification`` (``mlp``, ``cnn``, ``resnet20`` on the image datasets): cross-entropy over
  10 classes; held-out metrics are test accuracy and mean test loss.
* ``lm`` (``gpt`` and ``gpt-ngram`` on the text datasets): next-byte prediction, cross-entropy at every position;
  held-out metrics are the validation loss (nats per byte), bits per byte (= loss / ln 2,
  since a token is one byte) and next-byte accuracy (the share of bytes predicted exactly).

One loss function serves both: outputs ``[..., classes]`` and targets ``[...]`` are flattened
to one prediction per row, which for a classifier is the identity.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .data import TEXT_DATASETS, TextWindows
from ..runtime.device import collective_device

#: models that predict the next byte of a text
LANGUAGE_MODELS = ("gpt", "gpt-ngram")

#: training defaults per task, for every setting the user leaves unset. Classification keeps
#: lowband's SGD recipe; the language model gets the recipe transformers are trained with:
#: AdamW (weight decay 0.1), a linear warm-up, then a cosine decay to 10% of the peak rate.
#: The peak lr 1e-3 was the best of 1e-3 / 3e-3 / 1e-2 (validation loss 2.62 / 2.78 / 3.12 nats
#: per byte after 150 steps, batch 16 x 128 bytes, 1 worker); batch 8 windows per worker keeps
#: a CPU step near 0.15 s (docs/workloads.md).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "classification": {"dataset": "fashion-mnist", "optimizer": "sgd", "lr": 0.05, "weight_decay": 1e-4,
                       "lr_schedule": "constant", "warmup_steps": 0, "batch_size": 64},
    "lm": {"dataset": "python-stdlib", "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1,
           "lr_schedule": "warmup-cosine", "warmup_steps": 20, "batch_size": 8},
}


def task_of(model: str) -> str:
    return "lm" if model in LANGUAGE_MODELS else "classification"


def defaults_for(model: str) -> dict[str, Any]:
    return dict(TASK_DEFAULTS[task_of(model)])


def check_pairing(model: str, dataset: str) -> None:
    """Raise ValueError (one sentence) for a model trained on the wrong kind of data."""
    if task_of(model) == "lm" and dataset not in TEXT_DATASETS:
        raise ValueError(f"model {model!r} is a byte-level language model; it needs a text dataset "
                         f"({', '.join(TEXT_DATASETS)}), not {dataset!r}")
    if task_of(model) != "lm" and dataset in TEXT_DATASETS:
        raise ValueError(f"dataset {dataset!r} is text; train it with a language model "
                         f"({', '.join(LANGUAGE_MODELS)}), not {model!r}")


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every prediction (a class per sample, or a byte per position)."""
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, data, rank: int, world_size: int, batch_size: int = 1000) -> dict[str, float]:
    """Held-out metrics over the whole split, each rank scoring a 1/world shard of its samples:
    ``test_accuracy`` (per prediction) and ``test_loss`` (mean cross-entropy per prediction);
    for text also ``bits_per_byte``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = torch.arange(rank, len(data), world_size)
    # correct, loss sum, predictions; where the backend's all-reduce takes them (NCCL: the GPU)
    totals = torch.zeros(3, dtype=torch.float64, device=collective_device() if world_size > 1 else "cpu")
    for start in range(0, idx.numel(), batch_size):
        x, y = (t.to(device) for t in data.batch(idx[start:start + batch_size]))
        out = model(x).flatten(0, -2)
        y = y.flatten()
        totals[0] += (out.argmax(1) == y).sum().item()
        totals[1] += F.cross_entropy(out, y, reduction="sum").item()
        totals[2] += y.numel()
    if world_size > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    metrics = {"test_accuracy": float(totals[0] / totals[2]), "test_loss": float(totals[1] / totals[2])}
    if isinstance(data, TextWindows):
        metrics["bits_per_byte"] = metrics["test_loss"] / math.log(2)
    return metrics


def describe_data(train, test) -> dict[str, Any]:
    """What the run summary records about a text corpus (which files, which bytes): a
    different Python installation gives a different corpus and so different numbers."""
    if not isinstance(train, TextWindows):
        return {}
    return {"corpus_files": [len(train.files), len(test.files)],
            "corpus_bytes": [train.stream.numel(), test.stream.numel()],
            "corpus_fingerprint": f"{train.fingerprint}/{test.fingerprint}"}
