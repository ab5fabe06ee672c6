"""The interface through which an algorithm sees a training iteration.

One iteration, as the engine drives it::

    model(x) ... loss.backward()        # on_gradient_ready(i) fires per parameter as its
                                        # gradient is accumulated (overlap communication here)
    engine.step()                       # -> algorithm.step(): finish/launch communication,
                                        #    write gradients, run the user's optimizer
    engine.synchronize()                # -> algorithm.drain(): no work in flight, the model
                                        #    holds the global weights (before eval / save)

The hooks are deliberately few but enough for the two lowband methods:

* CP-SGD keeps one communication in flight *across* ``step()`` calls and keeps global weights
  apart from the model's compute weights — ``step()`` owns the optimizer call, and ``drain()``
  settles the pipeline.
* The lazy update defers some parameters' communication for several steps — an algorithm
  decides per parameter what ``on_gradient_ready`` does and which gradients reach the
  optimizer (``p.grad = None`` makes torch optimizers skip a parameter).

An algorithm object is configuration until :meth:`bind` attaches it to a model, optimizer and
process group; its ``config()`` is what ranks must agree on.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from ..collectives.communicator import Communicator


@dataclass
class EngineContext:
    """What an algorithm is bound to. ``params`` holds the trainable parameters in
    registration order with their qualified names (tied parameters appear once)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    names: list[str]
    params: list[nn.Parameter]
    comm: Communicator

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size


class Algorithm(ABC):
    """Base class for data-parallel algorithms. Subclasses are dataclasses whose fields are
    the documented knobs; ``name`` is the registry name used by the CLI."""

    name: ClassVar[str] = "base"
    #: whether the engine should call :meth:`on_gradient_ready` during backward
    uses_gradient_hooks: ClassVar[bool] = True

    def config(self) -> dict[str, Any]:
        """The knobs, as plain data (logged, and compared across ranks)."""
        cfg = dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}
        return {"algorithm": self.name, **{k: v for k, v in cfg.items() if not k.startswith("_")}}

    def wrap_module(self, model: nn.Module) -> nn.Module:
        """The module the user should call for forward (peers such as DDP wrap it)."""
        return model

    @abstractmethod
    def bind(self, ctx: EngineContext) -> None:
        """Attach to a model/optimizer/process group; allocate buffers and state."""

    def on_gradient_ready(self, index: int) -> None:
        """``ctx.params[index].grad`` has just been accumulated during backward."""

    @abstractmethod
    def step(self) -> None:
        """Called once per iteration after backward; must advance the optimizer."""

    def drain(self) -> None:
        """Finish all in-flight work so the model holds the global weights."""

    def global_parameters(self) -> "Optional[list[torch.Tensor]]":
        """The global model's parameter values, aligned with ``ctx.params``, for evaluating or
        checking the global model without changing training state (callers must not modify
        them). ``None``: the model's own parameters are the global model. An algorithm whose
        replicas differ between syncs (local SGD) may compute an average here, on copies."""
        return None

    def step_metrics(self) -> dict[str, Any]:
        """Plain-data values of the step just taken that the training loop logs in
        ``steps.jsonl`` (the lazy update's tau and sync flag, CP-SGD's correction flag, ...).
        Must not communicate and must not change state."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Plain-data facts about the run that the training loop writes into ``summary.json``
        under ``algorithm_summary`` at the end (the lazy update's lazy layers, ...). Must not
        communicate and must not change state."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Trajectory-relevant state (residuals, counters, pipeline), keyed by parameter name."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state but was given {sorted(state)}")

    def close(self) -> None:
        """Release hooks and buffers."""
