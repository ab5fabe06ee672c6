"""One step of the user's optimizer at a multiple of its learning rate.

cp-diloco averages the ranks' inner optimizer *steps*, not their gradients. For SGD that is
the same thing; for Adam it is not: each rank divides by the second moment of its own
batch's gradients, which holds N times the noise variance of the averaged batch that a
synchronous (``ssgd``/DDP) step divides by. Where the noise dominates that moment, the mean
of N Adam steps on batch-B gradients moves like one Adam step at ``lr / sqrt(N)`` on the
batch-NB mean, so the inner steps are taken at ``sqrt(N)`` times the user's rate to keep the
user's recipe (docs/cp-diloco.md, "The inner steps' rate").
"""
from __future__ import annotations

import math

import torch

from .tentative import using_hyperparameters


def normalizes_by_second_moment(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` divides its step by a running second moment of the gradient:
    torch's Adam and AdamW (a subclass of Adam in torch 2.13) and their subclasses."""
    return isinstance(optimizer, torch.optim.Adam)


def resolve_scale(spec, optimizer: torch.optim.Optimizer, world_size: int) -> float:
    """The multiplier of the inner steps' learning rate: a number as given; ``"auto"``:
    ``sqrt(world_size)`` for an optimizer that :func:`normalizes_by_second_moment`, 1 for
    any other (SGD's averaged steps are its averaged gradients' step)."""
    if spec == "auto":
        return math.sqrt(world_size) if normalizes_by_second_moment(optimizer) else 1.0
    return float(spec)


def step_scaled(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """``optimizer.step()`` with every group's ``lr`` multiplied by ``scale`` for this step.
    Decoupled weight decay (AdamW's ``p <- p (1 - lr wd)``) keeps its rate per step: its
    coefficient is divided by ``scale`` for the step, since the decay is no average of noisy
    gradients. The groups' own values are put back after the step (also when it raises), so
    a learning-rate scheduler and the optimizer's ``state_dict`` never see the scaled ones."""
    if scale == 1.0:
        optimizer.step()
        return
    scaled = []
    for group in optimizer.param_groups:
        settings = {"lr": group["lr"] * scale}
        if group.get("decoupled_weight_decay") and group.get("weight_decay"):
            settings["weight_decay"] = group["weight_decay"] / scale
        scaled.append(settings)
    with using_hyperparameters(optimizer, scaled):
        optimizer.step()
