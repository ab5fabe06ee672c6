"""``lowband.distribute``: attach a data-parallel algorithm to a model and optimizer.

The engine knows no specific algorithm. It owns what every algorithm needs and no algorithm
should repeat: the parameter list, identical starting weights on every rank, the
gradient-ready hooks, byte/time statistics, buffer consistency and checkpointable state.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .agreement import check_agreement
from .algorithms import Algorithm, EngineContext, make_algorithm
from .collectives.communicator import CommStats, Communicator, flatten, unflatten_into
from .guard import NONFINITE_POLICIES, GradientGuard

STATE_VERSION = 1


class Engine:
    """Drives one algorithm for one model. Create it with :func:`distribute`.

    Usage per iteration: ``optimizer.zero_grad(); loss.backward(); engine.step()``. Call
    ``engine.synchronize()`` before evaluating or saving, so the model holds the global
    weights and every rank holds the same buffers.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        algorithm: Algorithm,
        group: Optional[dist.ProcessGroup] = None,
        nonfinite: str = "raise",
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "lowband.distribute needs an initialized torch.distributed process group: start the "
                "script with torchrun, or use `lowband train`, or call torch.distributed.init_process_group first")
        self.model = model
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.comm = Communicator(group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._check_optimizer()
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {nonfinite!r}")
        # before any collective whose shape depends on the configuration (the broadcast below)
        check_agreement(self.agreement_fields(nonfinite), self.comm.group)
        self.guard = GradientGuard(nonfinite, self.names, self.params, self.comm.group)
        self._broadcast_initial_state()
        self.ctx = EngineContext(model=model, optimizer=optimizer, names=self.names, params=self.params, comm=self.comm)
        algorithm.bind(self.ctx)
        self.module = algorithm.wrap_module(model)
        self._hooks = []
        self._forward = algorithm.on_gradient_ready if algorithm.uses_gradient_hooks else None
        if algorithm.uses_gradient_hooks or self.guard.active:
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    # -- setup ---------------------------------------------------------------------------
    def _make_hook(self, index: int):
        guard, forward = self.guard, self._forward

        if not guard.active:
            def hook(_param: torch.Tensor) -> None:
                forward(index)
        else:
            def hook(_param: torch.Tensor) -> None:
                guard.on_gradient(index, forward)
        return hook

    def agreement_fields(self, nonfinite: str) -> dict[str, Any]:
        """What every rank must agree on before training (see :mod:`lowband.agreement`)."""
        return {
            "algorithm": self.algorithm.config(),
            "parameters": {n: [list(p.shape), str(p.dtype)] for n, p in zip(self.names, self.params)},
            "buffers": {n: [list(b.shape), str(b.dtype)] for n, b in self.model.named_buffers()},
            "optimizer": {"type": type(self.optimizer).__name__,
                          "groups": [{k: v for k, v in g.items() if k != "params"} | {"size": len(g["params"])}
                                     for g in self.optimizer.param_groups]},
            "world": {"size": self.comm.world_size, "backend": str(dist.get_backend(self.comm.group))},
            "nonfinite": nonfinite,
        }

    def _check_optimizer(self) -> None:
        model_ids = {id(p) for p in self.model.parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in model_ids:
                    raise ValueError("the optimizer holds a tensor that is not a parameter of the model; "
                                     "build the optimizer from model.parameters()")

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (one coalesced broadcast per dtype)."""
        tensors = [p.data for p in self.model.parameters()] + list(self.model.buffers())
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = flatten(group)
                self.comm.broadcast(flat, src=0)
                unflatten_into(flat, group)

    # -- per iteration -------------------------------------------------------------------
    @property
    def stats(self) -> CommStats:
        """Bytes sent/received (wire model), payload bytes, exposed communication wait, steps."""
        return self.comm.stats

    def step(self) -> bool:
        """Finish this iteration's communication and advance the optimizer. Returns False when
        the step was skipped on every rank for a non-finite gradient (``nonfinite="skip"``);
        callers then leave their LR scheduler alone, as if the step had not happened."""
        if self.guard.active:
            if not self.guard.check(self.comm.stats.steps + 1):
                self.comm.stats.steps += 1
                self.comm.stats.skipped_steps += 1
                return False
            self.guard.replay(self._forward)
        self.algorithm.step()
        self.comm.stats.steps += 1
        return True

    def synchronize(self) -> None:
        """Drain in-flight work (the model then holds the global weights) and average the
        floating-point buffers (BatchNorm running statistics) so every rank evaluates and
        saves the same model. Buffers are averaged here rather than every step: in training
        mode BatchNorm normalises with batch statistics, so the running averages only matter
        when the model is evaluated or saved."""
        self.algorithm.drain()
        floats = [b for b in self.model.buffers() if b.is_floating_point()]
        if floats and self.comm.world_size > 1:
            with torch.no_grad():
                flat = flatten(floats)
                self.comm.all_reduce(flat, op=dist.ReduceOp.AVG)
                unflatten_into(flat, floats)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's engine state: algorithm state (residuals, pipeline, counters) and
        statistics. The model, optimizer and scheduler are saved by their own state_dicts."""
        return {
            "version": STATE_VERSION,
            "algorithm_config": self.algorithm.config(),
            "algorithm": self.algorithm.state_dict(),
            "stats": self.comm.stats.snapshot(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"engine state version {state.get('version')!r} is not {STATE_VERSION}")
        saved = state["algorithm_config"]
        if saved != self.algorithm.config():
            raise ValueError(f"checkpoint was written by {saved}, but this engine runs {self.algorithm.config()}")
        self.algorithm.load_state_dict(state["algorithm"])
        self.comm.stats.load(state["stats"])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.algorithm.close()


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    algorithm: "str | Algorithm" = "ssgd",
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    nonfinite: str = "raise",
    **algorithm_options: Any,
) -> Engine:
    """Make ``model`` train data-parallel with ``algorithm`` (a registry name such as
    ``"ssgd"`` plus options, or an algorithm object such as ``lowband.SSGD(bucket_mb=4)``).

    Requires an initialized torch.distributed process group. Rank 0's parameters and
    buffers are broadcast so all ranks start identical. Call ``engine.module`` for forward
    (it is ``model`` itself unless the algorithm wraps it).

    Reliability (docs/reliability.md): all ranks first check that they agree on the
    algorithm configuration, parameter layout, optimizer and world (else every rank raises
    :class:`lowband.ConfigMismatchError`); ``nonfinite`` ("raise", "skip" or "off") is what
    every rank does, together, when some rank's gradient holds a NaN or Inf.
    """
    return Engine(model, optimizer, make_algorithm(algorithm, **algorithm_options), process_group, nonfinite)
