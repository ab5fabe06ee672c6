"""A short scheduler slice for the communication threads (``lowband.runtime.comm_threads``):
it reaches those threads and only them, and a training worker gives it to them."""
from __future__ import annotations

import json
import threading

import pytest

from lowband.runtime import comm_threads

from .test_cli import lowband


def test_a_slice_the_kernel_would_clamp_is_an_error():
    for bad in (-1, 1, 99, 100_001, 2.5, True, "100"):
        with pytest.raises(ValueError, match="slice_us must be 0"):
            comm_threads.check_slice(bad)
    for good in (0, 100, 5000, 100_000):
        comm_threads.check_slice(good)
    with pytest.raises(ValueError, match=r"slice_us must be 0 \(the kernel's default\) or an integer in "
                                         r"\[100, 100000\], got 50"):
        comm_threads.shorten(50)


class _Named(threading.Thread):
    """A thread that takes a kernel name, reports its id and sleeps until released."""

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True)
        self.kernel_name, self.tid = name, None
        self.ready, self.release = threading.Event(), threading.Event()

    def run(self) -> None:
        comm_threads.name_this_thread(self.kernel_name)
        self.tid = threading.get_native_id()
        self.ready.set()
        self.release.wait(30)


def test_shorten_reaches_the_named_communication_threads_and_no_other():
    threads = {name: _Named(name) for name in ("gloo_tcp_loop", "lowband-pipe", "pt_main_thread", "worker")}
    for t in threads.values():
        t.start()
        t.ready.wait(10)
    try:
        found = comm_threads.comm_threads()
        assert {threads["gloo_tcp_loop"].tid, threads["lowband-pipe"].tid} <= set(found)
        assert threads["pt_main_thread"].tid not in found and threads["worker"].tid not in found
        try:
            before = {name: comm_threads.read_slice_ns(t.tid) for name, t in threads.items()}
            own = comm_threads.read_slice_ns(0)
        except OSError as e:     # no sched_getattr here (not Linux, or a sandbox refuses it)
            pytest.skip(f"sched_getattr unavailable: {e}")
        assert comm_threads.shorten(0) == 0
        assert {name: comm_threads.read_slice_ns(t.tid) for name, t in threads.items()} == before
        done = comm_threads.shorten(250)
        if done is None:
            pytest.skip("this kernel takes no custom EEVDF slices (before Linux 6.12)")
        assert done >= 2 and 250_000 not in before.values()
        for name, t in threads.items():
            want = 250_000 if name in ("gloo_tcp_loop", "lowband-pipe") else before[name]
            assert comm_threads.read_slice_ns(t.tid) == want, name
        assert comm_threads.read_slice_ns(0) == own          # the calling (training) thread
        comm_threads.set_slice_ns(threads["lowband-pipe"].tid, 0)     # 0: back to the default
        assert comm_threads.read_slice_ns(threads["lowband-pipe"].tid) == before["lowband-pipe"]
    finally:
        for t in threads.values():
            t.release.set()
            t.join(10)


def test_training_workers_give_their_communication_threads_the_short_slice(tmp_path):
    """cpsgd on 2 gloo workers: after the first step the pipeline's and gloo's threads take
    the workers' slice, and the run summary says how many did."""
    run = tmp_path / "run"
    r = lowband("train", "--workers", "2", "--model", "mlp", "--dataset", "synthetic", "--max-steps", "6",
                "--batch-size", "32", "--algorithm", "cpsgd", "--option", "warmup_steps=2", "--no-progress",
                "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    summary = json.load(open(run / "summary.json"))
    assert summary["comm_slice_us"] == comm_threads.WORKER_SLICE_US == 100
    sliced = summary["rank0_comm_threads_sliced"]
    # gloo's threads of the world and private groups plus the pipeline's (None: an old kernel)
    assert sliced is None or sliced >= 3


def _settled_on_a_new_group(rank: int, world: int):
    import torch
    import torch.distributed as dist
    group = dist.new_group(list(range(world)), backend="gloo")   # its threads start as it connects
    try:
        done = comm_threads.shorten_settled(100, group)
    except OSError:
        return None
    dist.all_reduce(torch.ones(4), group=group)
    dist.barrier(group=group)
    slices = {tid: comm_threads.read_slice_ns(tid) for tid in comm_threads.comm_threads()}
    return done, slices


def test_shorten_settled_reaches_every_thread_of_a_group_just_made():
    """Right after ``new_group`` gloo's worker threads of the group are not all there or named;
    the settled variant runs a collective first, so no thread a later collective uses keeps the
    kernel's default slice."""
    from .distributed import run_distributed
    for out in run_distributed(_settled_on_a_new_group, 2):
        if out is None or out[0] is None:
            pytest.skip("this kernel or sandbox takes no custom EEVDF slices")
        done, slices = out
        assert done == len(slices) >= 4      # two groups' tcp loop and run loops at least
        assert set(slices.values()) == {100_000}
    with pytest.raises(ValueError, match="slice_us must be 0"):
        comm_threads.shorten_settled(7)
