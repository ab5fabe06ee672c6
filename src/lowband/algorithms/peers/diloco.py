"""DiLoCo and Streaming DiLoCo, run by PyTorch's reference implementation (torchft 0.2.0), as
peers lowband is compared against (docs/peers.md).

DiLoCo (Douillard et al., 2023): every worker takes ``sync_every`` (H) steps of its own inner
optimizer, then the workers average their pseudo-gradient (global weights minus local weights)
and an outer Nesterov-SGD step moves the global weights; every worker restarts from them.
Streaming DiLoCo (Douillard et al., 2025) cuts the model into ``fragments`` and syncs one
fragment every H / fragments steps, launching its all-reduce ``fragment_sync_delay`` inner steps
before it is needed (overlap), and mixes the new global fragment with the local one
(``fragment_update_alpha``: 0 takes the global weights, as DiLoCo does).

How lowband runs it: each worker is one torchft replica group of one process. Rank 0 starts a
torchft lighthouse inside its process, bound to its own address (loopback, or its namespace's
address behind an emulated link), and stops it in :meth:`close`. Every worker runs a torchft
``Manager`` on ``ProcessGroupGloo`` with its own TCPStore, advertising its own address (torchft
would advertise the machine's host name). The lowband engine has already broadcast rank 0's
weights, so the manager starts with ``init_sync=False``; quorums are synchronous
(``use_async_quorum=False``, which torchft's DiLoCo requires) and need every worker
(``min_replica_size`` = world size).

Bytes: torchft's all-reduces bypass lowband's Communicator, so the manager's ``allreduce`` is
wrapped to record each tensor it sends into the engine's statistics with lowband's ring
all-reduce formula (:func:`lowband.comm.wire.allreduce_bytes`): the exact tensors torchft
sends, counted by lowband's wire model; the quorum and commit RPCs to the lighthouse and the
managers are not in that count (the link counters of ``lowband bench`` see them). The time a
worker blocks in a sync (waiting for the all-reduce, the commit vote and the outer step) is
charged to the exposed communication wait.

Commits: when torchft's commit vote fails, it silently resets the parameters to the last global
weights and carries on. lowband runs the manager with ``max_retries=0`` (a failed vote raises)
and also counts the manager's committed syncs against the schedule after every step, so a lost
commit ends the run with one line instead of a quietly different result. torchft's quantized
outer gradients (``should_quantize``) are not exposed: without triton they are silently ignored
on CPU, and with triton but no accelerator every sync fails.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...comm.wire import allreduce_bytes
from ..base import Algorithm, BoundAlgorithm, EngineContext, Finiteness

#: the torchft release these peers are written against (``pip install 'lowband[peers]'``)
TORCHFT_VERSION = "0.2.0"
#: the quieter log level for torchft's Rust servers (they log every quorum at info)
RUST_LOG_LEVEL = "warn"


class _NoNcclNoise(logging.Filter):
    """torchft warns at every quorum that it cannot reset NCCL's flight recorder, also on gloo."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


class CommitFailed(RuntimeError):
    """torchft did not commit a sync (and so reset the parameters behind lowband's back)."""


def torchft_unavailable() -> Optional[str]:
    """Why torchft cannot run here (one line), or None when it can."""
    if importlib.util.find_spec("torchft") is None:
        return f"torchft is not installed (pip install 'lowband[peers]', torchft=={TORCHFT_VERSION})"
    return None


def own_address(peer: str) -> str:
    """The local IP address this host uses to reach ``peer`` (loopback for loopback; the
    namespace's veth address behind an emulated link). No packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


class _Fragment(nn.Module):
    """A view of some of the model's parameters as one module (the same Parameter objects),
    which is what torchft's DiLoCo takes as a model fragment."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "__"), p)


def fragment_count(fragments: Optional[int], most: int, tensors: int, sync_every: int, delay: int) -> int:
    """``fragments`` when set (more than the model's tensors is refused by
    :func:`split_fragments`); None: the largest count up to ``most`` that the model has
    ``tensors`` for, that divides ``sync_every`` and leaves a period longer than ``delay``."""
    if fragments is not None:
        return fragments
    for count in range(min(most, tensors), 1, -1):
        if sync_every % count == 0 and delay < sync_every // count:
            return count
    return 1


def split_fragments(params: list[nn.Parameter], count: int) -> list[list[int]]:
    """Parameter indices, in registration order, cut into ``count`` contiguous non-empty runs
    of about equal size in elements (the Streaming DiLoCo paper fragments by consecutive
    layers)."""
    if count > len(params):
        raise ValueError(f"fragments={count} is more than the model's {len(params)} parameter tensors")
    total = sum(p.numel() for p in params)
    out: list[list[int]] = [[]]
    seen = 0
    for i, p in enumerate(params):
        left, unopened = len(params) - i, count - len(out)
        # open the next run when this one holds its share, or when every remaining tensor
        # is needed to give each remaining run one
        if out[-1] and unopened > 0 and (seen >= total * len(out) / count or left <= unopened):
            out.append([])
        out[-1].append(i)
        seen += p.numel()
    return out


@dataclass
class DiLoCo(Algorithm):
    """DiLoCo through torchft (see the module docstring).

    Knobs:
        sync_every: H, inner steps between two syncs of the whole model (with fragments, one
            fragment syncs every H / fragments steps). 32: the fastest to the target in the
            tuning sweep at 20 Mbit/s (cnn, 2 workers; 16 and 8 took 2.2x and longer) and within
            15% of the fastest at 200 Mbit/s (docs/peers.md, "Tuning"); the DiLoCo paper uses
            500 on runs of many thousand steps.
        fragments: pieces the model is cut into (contiguous runs of parameters of about equal
            size); 1 is DiLoCo. ``sync_every`` must be a multiple of it, and the model must
            have at least as many parameter tensors. None: the largest count up to the
            algorithm's own (1 here, 4 for ``streaming-diloco``) that the model has tensors
            for and that divides ``sync_every`` with room for the delay (in the summary).
        fragment_sync_delay: inner steps between launching a fragment's all-reduce and
            waiting for it (the overlap, tau in the Streaming DiLoCo paper); must be less than
            sync_every / fragments. 0: no overlap.
        fragment_update_alpha: after a sync, weight of the local fragment in the mix with the
            new global one (0: take the global weights).
        outer_lr, outer_momentum: the outer optimizer, SGD with Nesterov momentum on the
            averaged pseudo-gradient; 0.7 and 0.9 are the DiLoCo paper's values.
        timeout_s: torchft's timeout for collectives, quorums and commit votes.
    """

    sync_every: int = 32
    fragments: Optional[int] = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    timeout_s: float = 120.0

    name: ClassVar[str] = "diloco"
    #: the most fragments ``fragments=None`` cuts the model into
    AUTO_FRAGMENTS: ClassVar[int] = 1

    @staticmethod
    def unavailable() -> Optional[str]:
        return torchft_unavailable()

    def __post_init__(self) -> None:
        def integer(key: str, low: int) -> int:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{self.name}: {key} must be an integer >= {low}, got {value!r}")
            return value

        integer("sync_every", 1)
        if self.fragments is not None:
            integer("fragments", 1)
        integer("fragment_sync_delay", 0)
        count = 1 if self.fragments is None else self.fragments     # None falls back as far as 1
        if self.sync_every % count:
            raise ValueError(f"{self.name}: sync_every ({self.sync_every}) must be a multiple of fragments "
                             f"({count})")
        if self.fragment_sync_delay >= self.sync_every // count:
            raise ValueError(f"{self.name}: fragment_sync_delay ({self.fragment_sync_delay}) must be less than "
                             f"sync_every / fragments ({self.sync_every // count})")
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise ValueError(f"{self.name}: fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"{self.name}: outer_lr must be > 0, got {self.outer_lr!r}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"{self.name}: outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"{self.name}: timeout_s must be > 0, got {self.timeout_s!r}")
        reason = torchft_unavailable()
        if reason:
            raise ValueError(f"{self.name}: {reason}")

    def fragments_for(self, tensors: int) -> int:
        """The fragment count a model of ``tensors`` parameter tensors runs with."""
        return fragment_count(self.fragments, self.AUTO_FRAGMENTS, tensors, self.sync_every, self.fragment_sync_delay)

    def bind(self, ctx: EngineContext) -> "BoundDiLoCo":
        return BoundDiLoCo(self, ctx)


class BoundDiLoCo(BoundAlgorithm):
    """DiLoCo bound to one engine: torchft's lighthouse (rank 0), manager and DiLoCo wrapper."""

    cfg: DiLoCo
    uses_gradient_hooks: ClassVar[bool] = False
    clips: ClassVar[bool] = True
    rebuildable: ClassVar[bool] = False     # torchft's manager and outer optimizer hold the parameters

    def __init__(self, cfg: DiLoCo, ctx: EngineContext) -> None:
        super().__init__(cfg, ctx)
        try:
            self._setup(ctx)
        except BaseException:
            self.close()          # a lighthouse or manager already started must not outlive us
            raise

    # -- setup ---------------------------------------------------------------------------
    def _setup(self, ctx: EngineContext) -> None:
        cfg = self.cfg
        os.environ.setdefault("RUST_LOG", RUST_LOG_LEVEL)
        logging.getLogger("torchft.manager").addFilter(_NoNcclNoise())
        from torchft import Manager, ProcessGroupGloo
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo as TorchftDiLoCo

        self._step = 0
        self._sync_wait_s = 0.0
        timeout = timedelta(seconds=cfg.timeout_s)
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        me = own_address(master)
        # rank 0 runs the lighthouse; the others learn its address through lowband's group
        self._lighthouse = None
        box: list[Any] = [None]
        if ctx.rank == 0:
            self._lighthouse = LighthouseServer(bind=f"{me}:0", min_replicas=ctx.world_size,
                                                join_timeout_ms=int(cfg.timeout_s * 1000))
            port = self._lighthouse.address().rsplit(":", 1)[1]   # it names the host, not the address
            box[0] = f"http://{me}:{port}"
        dist.broadcast_object_list(box, src=0, group=ctx.comm.group)
        self._store = dist.TCPStore(host_name=me, port=0, is_master=True, wait_for_workers=False)
        model, optimizer = ctx.model, ctx.optimizer
        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
            min_replica_size=ctx.world_size, use_async_quorum=False, init_sync=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=0, world_size=1, store_addr=me, store_port=self._store.port,
            lighthouse_addr=box[0], replica_id=f"lowband_{ctx.rank}", hostname=me, max_retries=0,
        )
        self._count_allreduce_bytes()
        self.fragments = cfg.fragments_for(len(ctx.params))
        self._groups = split_fragments(ctx.params, self.fragments)
        fragment_modules = [_Fragment([(ctx.names[i], ctx.params[i]) for i in g]) for g in self._groups]
        outer = [torch.optim.SGD(m.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                 nesterov=cfg.outer_momentum > 0) for m in fragment_modules]
        self._diloco = TorchftDiLoCo(
            self._manager, fragment_modules, ctx.optimizer, outer, sync_every=cfg.sync_every,
            fragment_sync_delay=cfg.fragment_sync_delay, fragment_update_alpha=cfg.fragment_update_alpha,
        )
        self._time_syncs()
        self._diloco.__enter__()
        self._local: Optional[list[torch.Tensor]] = None      # the model's own weights during a drain
        self._restore_hook = ctx.model.register_forward_pre_hook(self._restore_local)

    def _count_allreduce_bytes(self) -> None:
        manager, stats, world = self._manager, self.ctx.comm.stats, self.ctx.world_size
        inner = manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any):
            n = tensor.numel() * tensor.element_size()
            wire = allreduce_bytes(n, world)
            stats.record("torchft_allreduce", n, wire, wire)
            return inner(tensor, *args, **kwargs)

        manager.allreduce = counted

    def _time_syncs(self) -> None:
        """Charge the time spent in each fragment's launch and sync to the exposed wait."""
        for fragment in self._diloco._fragments:
            for method in ("prepare_sync", "perform_sync"):
                inner = getattr(fragment, method)

                def timed(*args: Any, _inner=inner, **kwargs: Any):
                    t0 = time.perf_counter()
                    try:
                        return _inner(*args, **kwargs)
                    finally:
                        self._sync_wait_s += time.perf_counter() - t0

                setattr(fragment, method, timed)

    # -- per iteration -------------------------------------------------------------------
    @property
    def _steps_per_sync(self) -> int:
        return self.cfg.sync_every // self.fragments

    def finiteness(self) -> Finiteness:
        """An inner step changes only this worker's model, so the engine's finiteness check is
        decided at the next ``step()``, before anything of that step is applied or sent: inner
        steps pay no per-step barrier.
        A step whose optimizer hook prepares or performs a fragment's sync (torchft's rule,
        from its own counters) decides at once, before its pseudo-gradient leaves."""
        d = self._diloco
        after = d._local_step + 1
        return Finiteness.NOW if after in (d._sync_every - d._fragment_sync_delay, d._sync_every) else Finiteness.LATE

    def step(self) -> None:
        before = self._sync_wait_s
        if self.ctx.clip is not None:      # the inner step's local gradient
            self.ctx.clip_gradients([p.grad for p in self.ctx.params])
        self.ctx.optimizer.step()          # torchft's post-step hook launches and performs syncs
        self._step += 1
        self.ctx.charge_wait(self._sync_wait_s - before)
        expected = self._step // self._steps_per_sync
        committed = self._manager.current_step()
        if committed != expected:
            raise CommitFailed(
                f"{self.name}: torchft committed {committed} of the {expected} syncs due by step {self._step} "
                f"(a failed commit resets the parameters to the last global weights); stopping")

    def global_parameters(self) -> Optional[list[torch.Tensor]]:
        """The global weights: each fragment's values after its last outer step (identical
        on every worker), which torchft keeps apart from the model between syncs."""
        values: list[Optional[torch.Tensor]] = [None] * len(self.ctx.params)
        for group, fragment in zip(self._groups, self._diloco._fragments):
            saved = fragment.original_parameters
            for i in group:
                values[i] = saved[self.ctx.names[i].replace(".", "__")].view_as(self.ctx.params[i])
        return values

    def replicated_state(self) -> "tuple[Optional[list[torch.Tensor]], bool]":
        """The global weights are replicated; the model (between syncs) and the inner
        optimizer's state are each worker's own."""
        return self.global_parameters(), False

    @torch.no_grad()
    def drain(self) -> None:
        """Wait for a fragment all-reduce in flight, then load the global weights into the
        model, so every worker holds (and evaluates) the same model. The local weights are
        kept aside and put back before the next forward pass in training mode, so a drain for
        an evaluation leaves the trajectory as it was; after the last drain the model stays
        global."""
        for fragment in self._diloco._fragments:
            for work in fragment._allreduce_work:
                work.wait()
        if self._local is None:
            self._local = [p.detach().clone() for p in self.ctx.params]
        for p, g in zip(self.ctx.params, self.global_parameters()):
            p.copy_(g)

    @torch.no_grad()
    def _restore_local(self, module: nn.Module, _inputs: Any) -> None:
        if self._local is not None and module.training:
            for p, v in zip(self.ctx.params, self._local):
                p.copy_(v)
            self._local = None

    def step_metrics(self) -> dict[str, Any]:
        return {"commits": self._manager.current_step()}

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "fragments": self.fragments}

    def state_dict(self) -> dict[str, Any]:
        raise ValueError(f"{self.name}: checkpoints are not supported for the torchft peers "
                         "(torchft keeps the outer state and any all-reduce in flight itself); "
                         "run without --checkpoint-every")

    def close(self) -> None:
        hook = getattr(self, "_restore_hook", None)
        if hook is not None:
            hook.remove()
        diloco = getattr(self, "_diloco", None)
        if diloco is not None:
            diloco.__exit__(None, None, None)
        manager = getattr(self, "_manager", None)
        if manager is not None:
            manager.shutdown(wait=False)
        if getattr(self, "_lighthouse", None) is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None


@dataclass
class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo through torchft: DiLoCo's knobs, with defaults for streaming: H = 32 in
    4 fragments (one syncs every 8 steps; fewer fragments for a model of fewer than 4 parameter
    tensors), each fragment's all-reduce launched one inner step before it is needed, and the
    new global fragment mixed half and half with the local one (the Streaming DiLoCo paper's
    alpha = 0.5). H = 32 in 4 fragments was the fastest to the target in the tuning sweep at 20
    Mbit/s (9.6 s against 12.6 s for H = 16 in 2) and tied at 200 Mbit/s (docs/peers.md,
    "Tuning")."""

    sync_every: int = 32
    fragments: Optional[int] = None
    fragment_sync_delay: int = 1
    fragment_update_alpha: float = 0.5

    name: ClassVar[str] = "streaming-diloco"
    AUTO_FRAGMENTS: ClassVar[int] = 4
