"""CUDA checks (``pytest -m cuda``; skipped without a GPU): codecs on CUDA tensors against the
CPU bit for bit where the codec is deterministic, collectives keeping the input's device and
dtype (gloo with CUDA tensors at world size 2, NCCL at world size 1), checkpointed state
reloading onto the GPU, the pipeline's side stream ordered with the compute stream by events
(lowband.comm.streams) and its waits timed with CUDA events, and a short
``lowband train --device cuda`` with a resume.

benchmarks/gpu_check.sh runs these on a GPU machine; they passed on one H200 (docs/results.md,
"First GPU run")."""
from __future__ import annotations

import pytest
import torch

from lowband.app import checkpoint
from lowband.comm.communicator import Communicator
from lowband.codecs import COMPRESSORS, build_compressor, make_compressor
from lowband.runtime.device import to_device
from lowband.comm.pipeline import Pipeline
from lowband.comm.reducer import make_reducer

from .cli_runs import PAST_WARMUP, train as lowband_train
from .distributed import run_distributed

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: codecs whose output is a function of each element alone (no reduction, no randomness), so
#: the GPU must reproduce the CPU bit for bit; the others are checked for device and dtype only
DETERMINISTIC = [("2bit", {"threshold": 0.5}), ("fp16", {}), ("bf16", {}), ("topk", {"ratio": 0.01}),
                 ("none", {})]
SEGMENTS = [("w1", 37), ("w2", 1000), ("w3", 5)]
#: options of the codecs that have none by default (the others take lowband's)
OPTIONS = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("name, options", DETERMINISTIC)
def test_deterministic_codecs_match_cpu_bit_for_bit(name, options):
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(3))
    out = {}
    for dev in ("cpu", "cuda"):
        codec = make_compressor(name, **options)
        payload, ctx = codec.compress(x.to(dev), "t")
        y = codec.decompress(payload, ctx)
        assert y.device.type == dev and y.dtype == x.dtype
        out[dev] = y
    assert torch.equal(_bits(out["cpu"]), _bits(out["cuda"]))


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_every_codec_keeps_device_and_dtype(name):
    x = torch.randn(4099, device="cuda")
    codec = build_compressor(name, OPTIONS.get(name, {}))
    payload, ctx = codec.compress(x, "t")
    y = codec.decompress(payload, ctx)
    assert y.device == x.device and y.dtype == x.dtype and y.shape == x.shape


#: more than one GPU: NCCL across ranks can be tested (it refuses two ranks on one GPU)
several_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL across ranks)")


def _gpu(rank: int) -> torch.device:
    """Rank's GPU: its own where there are enough, else shared (gloo only)."""
    return torch.device("cuda", rank % torch.cuda.device_count())


def _reduce_on_cuda(rank: int, world: int):
    dev = _gpu(rank)
    torch.cuda.set_device(dev)
    found = []
    for kind in ("allgather", "two-stage"):
        red = make_reducer(kind, Communicator(), make_compressor("2bit", threshold=0.5))
        total = sum(n for _, n in SEGMENTS)
        x = torch.randn(total, generator=torch.Generator().manual_seed(rank)).to(dev)
        for _ in range(2):
            y = red.start(x, "b", SEGMENTS).wait()
            found.append((kind, str(y.device), str(y.dtype)))
        found.append((kind + " residuals", sorted({str(v.device) for v in red.state_dict()["worker"].values()}), ""))
        red.close()
    plain = torch.ones(8, device=dev)
    Communicator().all_reduce(plain)
    found.append(("all_reduce", str(plain.device), str(float(plain.sum()))))
    return found


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=several_gpus)])
def test_two_ranks_with_cuda_tensors_keep_device_and_dtype(backend):
    for rank, rank_result in enumerate(run_distributed(_reduce_on_cuda, 2, backend=backend)):
        gpu = str(_gpu(rank))
        for what, device, dtype in rank_result[:-1]:
            assert device in (gpu, [gpu]), (what, device)
            assert dtype in ("torch.float32", ""), (what, dtype)
        assert rank_result[-1] == ("all_reduce", gpu, str(8.0 * 2))


def test_nccl_world_of_one_keeps_device_and_dtype():
    result = run_distributed(_reduce_on_cuda, 1, backend="nccl")[0]
    for what, device, dtype in result[:-1]:
        assert device in ("cuda:0", ["cuda:0"]), (what, device)
    assert result[-1] == ("all_reduce", "cuda:0", "8.0")


#: the fused bucket codecs (native kernels on the CPU, torch path or Triton on CUDA)
FUSED = [("2bit", {"threshold": 0.5}), ("2bit", {"relative": 1.0, "scale_block": 256}),
         ("2bit", {"relative": 0.7, "scale_block": 100}), ("1bit", {})]


def _reduce_bits(rank: int, world: int, device: str, name: str, options: dict):
    """Three error-feedback steps of each reducer on ``device``: the outputs and residuals,
    moved to the CPU."""
    dev = _gpu(rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    segments = [("a", 37), ("b", 1000), ("c", 5), ("d", 4099)]
    total = sum(n for _, n in segments)
    found = []
    for kind in ("allgather", "two-stage"):
        red = make_reducer(kind, Communicator(), make_compressor(name, **options))
        # the same steps averaged into their input (the reducer's in_place)
        into = make_reducer(kind, Communicator(), make_compressor(name, **options))
        for step in range(3):
            x = torch.randn(total, generator=torch.Generator().manual_seed(100 * rank + step)).to(dev)
            found.append(red.start(x, "b", segments).wait().cpu())
            buffer = x.clone()
            same = into.start(buffer, "b", segments, copy=False, in_place=True).wait().data_ptr() == buffer.data_ptr()
            found.extend([torch.tensor([float(same)]), buffer.cpu()])
        found.extend(v.cpu() for _, v in sorted(red.state_dict()["worker"].items()))
        red.close()
        into.close()
    return found


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=several_gpus)])
@pytest.mark.parametrize("name, options", FUSED)
def test_fused_reducers_on_cuda_equal_the_cpu_bit_for_bit(name, options, backend):
    """The same reduction over gloo with CPU tensors (native kernels) and with CUDA tensors
    (over gloo, or NCCL where each rank has a GPU): every output and residual equal bit for bit,
    also where the average is written into the input (``in_place``)."""
    cpu = run_distributed(_reduce_bits, 2, "cpu", name, options)
    gpu = run_distributed(_reduce_bits, 2, "cuda", name, options, backend=backend)
    for rank in range(2):
        assert len(cpu[rank]) == len(gpu[rank])
        for k, (a, b) in enumerate(zip(cpu[rank], gpu[rank])):
            assert torch.equal(_bits(a), _bits(b)), (rank, k)


#: GPU cycles of ``torch.cuda._sleep``: long enough (tens of ms on any recent GPU) that a
#: missing stream order would let the other stream read the old values
SLEEP_CYCLES = 50_000_000


def _stream_order(rank: int, world: int):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    comm = Communicator()
    pipeline = Pipeline(comm, "stream-test")
    found = {}
    # the job must see what the compute stream wrote before the submit, however late it runs
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(7.0)

    def read(t):
        found["job stream is the side stream"] = torch.cuda.current_stream(dev) == pipeline.side.stream
        return t.clone(), None
    seen = pipeline.submit(read, x).wait()
    found["job saw the compute stream's write"] = bool((seen == 7.0).all())
    # the compute stream must see what the job wrote, without a host sync in between

    def write(t):
        torch.cuda._sleep(SLEEP_CYCLES)
        return t.fill_(3.0), None
    out = pipeline.submit(write, torch.zeros(1 << 20, device=dev)).wait()
    found["compute stream saw the job's write"] = bool((out.clone() == 3.0).all())
    # the wait for the sleeping job was charged from CUDA events, collected when asked
    comm.stats.collect_gpu_waits(block=True)
    found["waits timed on the GPU"] = comm.stats.comm_wait_s > 0
    # a reducer's residuals saved to the CPU reload onto the GPU and continue the same
    red = make_reducer("allgather", comm, make_compressor("2bit", threshold=0.5))
    g = torch.randn(sum(n for _, n in SEGMENTS), generator=torch.Generator().manual_seed(1)).to(dev)
    red.start(g, "b", SEGMENTS).wait()
    saved = to_device(red.state_dict(), torch.device("cpu"))
    again = make_reducer("allgather", comm, make_compressor("2bit", threshold=0.5))
    again.load_state_dict(saved)
    found["reloaded residuals continue bit for bit"] = torch.equal(red.start(g, "b", SEGMENTS).wait(),
                                                                   again.start(g, "b", SEGMENTS).wait())
    found["residuals on the GPU"] = {v.device.type for v in again.state_dict()["worker"].values()} == {"cuda"}
    for p in (red, again, pipeline):
        p.close()
    return found


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_pipeline_side_stream_is_ordered_by_events(backend):
    found = run_distributed(_stream_order, 1, backend=backend)[0]
    assert found and all(found.values()), found


def test_checkpoint_state_reloads_onto_the_gpu(tmp_path):
    state = {"engine": {"algorithm": {"worker": {"w": torch.randn(5)}}}, "rng": {"torch": torch.get_rng_state()}}
    checkpoint.save(str(tmp_path), 0, 1, 3, state, {}, lambda d: [d], keep=1)
    loaded = checkpoint.load(str(tmp_path), 0, 1, map_location=torch.device("cuda", 0))
    assert loaded["engine"]["algorithm"]["worker"]["w"].device.type == "cuda"
    assert loaded["rng"]["torch"].device.type == "cpu"
    torch.set_rng_state(loaded["rng"]["torch"])


@pytest.mark.parametrize("workers, backend", [(1, "nccl"), (2, "gloo"), pytest.param(2, "nccl", marks=several_gpus)])
def test_train_on_cuda_and_resume(tmp_path, workers, backend):
    """Past the warm-up (residuals exist), checkpoint, resume onto the GPU, continue (the
    backend named: a machine with 2 GPUs would pick NCCL for 2 ranks by itself)."""
    run = str(tmp_path / "run")
    flags = ["--device", "cuda", "--workers", str(workers), "--algorithm", "compressed", *PAST_WARMUP["compressed"],
             "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16", "--no-progress",
             "--checkpoint-every", "4"]
    first = lowband_train([*flags, "--run-dir", run, "--max-steps", "4"], LOWBAND_BACKEND=backend)
    assert first.returncode == 0, first.stderr
    assert f"device cuda:0, backend {backend}" in first.stdout
    again = lowband_train([*flags, "--resume", run, "--max-steps", "8"], LOWBAND_BACKEND=backend)
    assert again.returncode == 0, again.stderr
