"""The device plumbing, checked on the CPU: --device resolution and its usage errors, the
backend choice, the rank's GPU, checkpointed state landing on the model's device (RNG state on
the CPU), and buffers following their input's device (``meta`` tensors)."""
from __future__ import annotations

import pytest
import torch

from lowband.app import checkpoint, cli
from lowband.runtime import device
from lowband.codecs.base import exact_divisor, scratch
from lowband.app.config import TrainConfig

from .distributed import run_distributed

META = torch.device("meta")


def test_resolve(monkeypatch):
    assert device.resolve("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.resolve("auto") == "cpu"
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available"):
        device.resolve("cuda")
    with pytest.raises(ValueError, match="--device must be one of"):
        device.resolve("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.resolve("auto") == "cuda"
    assert device.resolve("cuda") == "cuda"


def test_backend_is_nccl_only_with_a_gpu_per_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device.backend_for("cuda", 1, env={}) == "nccl"
    assert device.backend_for("cuda", 2, env={}) == "gloo"     # NCCL refuses two ranks on one GPU
    assert device.backend_for("cpu", 1, env={}) == "gloo"
    assert device.backend_for("cuda", 1, env={device.BACKEND_ENV: "gloo"}) == "gloo"
    with pytest.raises(ValueError, match=device.BACKEND_ENV):
        device.backend_for("cuda", 1, env={device.BACKEND_ENV: "mpi"})
    assert device.local_world_size(4, env={"LOCAL_WORLD_SIZE": "2"}) == 2
    assert device.local_world_size(4, env={}) == 4


def test_bind_picks_local_rank_else_rank_modulo_gpus(monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device.bind("cpu", 3, env={}) == torch.device("cpu") and current == []
    assert device.bind("cuda", 4, env={"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert device.bind("cuda", 5, env={}) == torch.device("cuda", 1)
    assert device.bind("cuda", 0, env={"LOCAL_RANK": "2"}) == torch.device("cuda", 0)   # two ranks per GPU
    assert current == [1, 1, 0]


def test_to_device_moves_every_tensor_and_keeps_the_rest():
    state = {"a": torch.zeros(3), "b": [torch.ones(2), 7, ("x", torch.arange(4))], "c": None}
    moved = device.to_device(state, META)
    assert moved["a"].device == META and moved["b"][0].device == META and moved["b"][2][1].device == META
    assert moved["b"][1] == 7 and moved["b"][2][0] == "x" and moved["c"] is None
    assert moved["b"][2][1].dtype == torch.int64


def test_checkpoint_state_lands_on_the_given_device_and_rng_on_the_cpu(tmp_path):
    """``load(map_location=...)`` puts the model and the engine state (residuals, accumulators,
    in-flight tensors) on that device, here ``meta``, which no CPU default could match, and
    leaves the RNG states on the CPU."""
    state = {"engine": {"algorithm": {"worker": {"w": torch.randn(5)}, "acc": [torch.zeros(2)]}},
             "model": {"fc.weight": torch.randn(2, 2)},
             "rng": {"torch": torch.get_rng_state(), "numpy": ["MT19937", torch.arange(3)]}}
    checkpoint.save(str(tmp_path), 0, 1, 3, state, {}, lambda d: [d], keep=1)
    loaded = checkpoint.load(str(tmp_path), 0, 1, map_location=META)
    assert loaded["engine"]["algorithm"]["worker"]["w"].device == META
    assert loaded["engine"]["algorithm"]["acc"][0].device == META
    assert loaded["model"]["fc.weight"].device == META
    assert loaded["rng"]["torch"].device.type == "cpu" and loaded["rng"]["numpy"][1].device.type == "cpu"
    plain = checkpoint.load(str(tmp_path), 0, 1)          # default: the CPU, as before
    assert torch.equal(plain["engine"]["algorithm"]["worker"]["w"], state["engine"]["algorithm"]["worker"]["w"])


def test_device_is_a_config_field_that_may_change_on_resume():
    assert TrainConfig().device == "cpu"
    with pytest.raises(ValueError, match="--device"):
        TrainConfig(device="tpu").validate()
    # a checkpoint from before --device (no such key) and one moved between devices both resume
    manifest = {"world_size": 2, "config": {"model": "cnn"}}
    checkpoint.check_resumable(manifest, {"model": "cnn", "device": "cpu"}, 2)
    checkpoint.check_resumable({"world_size": 2, "config": {"device": "cuda"}}, {"device": "cpu"}, 2)


@pytest.mark.parametrize("command", [["train"], ["bench", "--algorithms", "ssgd"]])
def test_device_cuda_without_cuda_is_a_one_line_usage_error(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = ["--run-dir", str(tmp_path / "r")] if command[0] == "train" else ["--out", str(tmp_path / "b")]
    assert cli.main([*command, *out, "--device", "cuda", "--max-steps", "1"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lowband: error: --device cuda: CUDA is not available"), err


def test_unknown_device_is_a_usage_error(capsys):
    assert cli.main(["train", "--device", "tpu"]) == cli.EXIT_USAGE
    assert "--device" in capsys.readouterr().err


def test_help_names_the_device_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--device {cpu,cuda,auto}" in capsys.readouterr().out


def test_scratch_buffers_follow_the_input_device_and_dtype():
    buf = scratch.get("device-test", 10, torch.float16, META)
    assert buf.device == META and buf.dtype == torch.float16 and buf.numel() == 10
    cpu = scratch.get("device-test", 10, torch.float32, torch.device("cpu"))
    assert cpu.device.type == "cpu" and cpu.dtype == torch.float32


def test_cpsgd_measurement_follows_the_parameters_device_and_dtype():
    """cpsgd's per-step measurement rides on the gradients' all-reduce, so it is created on the
    parameters' device (here the CPU; tests/test_cuda.py trains cpsgd-free runs on the GPU)."""
    from types import SimpleNamespace
    from lowband.algorithms import cpsgd
    bucket = SimpleNamespace(numel=6, index=0, param_indices=[0], offsets=[0])
    flight = SimpleNamespace(algo=SimpleNamespace(buckets=SimpleNamespace(buckets=[bucket])), ranges=[(0, 2, 4)])
    params = [torch.nn.Parameter(torch.zeros(6))]
    m = cpsgd._measurement(flight, [torch.ones(6)], [torch.zeros(6)], params)
    assert m.device == params[0].device and m.dtype == torch.float32
    assert m.tolist() == [4.0, 4.0, 2.0, 2.0]     # (d, n_compressed, v, n_exact)


# -- no host sync on the per-step path: where a value is read back, `meta` (which has none) raises


def test_a_bucket_launched_complete_is_written_back_without_reading_its_flags():
    """Every parameter of this rank had a gradient: the averaged flags are all > 0, so
    ``write_gradients`` must not read them back (a host sync per bucket on CUDA). On ``meta``
    a read-back raises; an incomplete bucket must read them (whether another rank had one)."""
    from lowband.algorithms.buckets import BucketSet
    params = [torch.nn.Parameter(torch.zeros(3, device=META)), torch.nn.Parameter(torch.zeros(2, device=META))]
    buckets = BucketSet(params, range(2), 1 << 20, launch=lambda b: None)
    for p in params:
        p.grad = torch.ones_like(p)
    for i in (1, 0):
        buckets.mark_ready(i)
    buckets.write_gradients(buckets.buckets[0])
    assert all(p.grad is not None and p.grad.device == META for p in params)
    buckets.reset()
    buckets.mark_ready(1)
    buckets.launch_remaining()
    with pytest.raises((NotImplementedError, RuntimeError)):
        buckets.write_gradients(buckets.buckets[0])


def test_cpsgd_measurement_reads_nothing_back():
    """The adaptive period's per-step measurement stays on the gradients' device (``meta``
    here, where reading a value back raises); its values are checked above on the CPU."""
    from types import SimpleNamespace
    from lowband.algorithms import cpsgd
    bucket = SimpleNamespace(numel=10, index=0, param_indices=[0, 1], offsets=[0, 6])
    flight = SimpleNamespace(algo=SimpleNamespace(buckets=SimpleNamespace(buckets=[bucket])),
                             ranges=[(0, 2, 4), (0, 3, 8)])
    params = [torch.nn.Parameter(torch.zeros(6, device=META)), torch.nn.Parameter(torch.zeros(4, device=META))]
    m = cpsgd._measurement(flight, [torch.ones(6, device=META), torch.ones(4, device=META)],
                           [torch.zeros(6, device=META), None], params)
    assert m.device == META and m.dtype == torch.float32 and m.shape == (4,)


def test_cpsgd_measurement_over_overlapping_exact_ranges():
    """Overlapping exact ranges (a 1-D parameter inside a correction share) count once."""
    from types import SimpleNamespace
    from lowband.algorithms import cpsgd
    bucket = SimpleNamespace(numel=10, index=0, param_indices=[0, 1], offsets=[0, 6])
    flight = SimpleNamespace(algo=SimpleNamespace(buckets=SimpleNamespace(buckets=[bucket])),
                             ranges=[(0, 2, 4), (0, 3, 8), (0, 9, 10)])
    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(4))]
    G = [torch.arange(6.0), torch.arange(4.0)]
    m = cpsgd._measurement(flight, G, [torch.zeros(6), None], params)
    sq = torch.cat(G).square()
    exact = torch.zeros(10, dtype=torch.bool)
    exact[2:8] = exact[9] = True
    assert m.tolist() == [float(sq[~exact].sum()), 3.0, float(sq[exact].sum()), 7.0]


def test_guard_reads_all_verdicts_back_at_once():
    """On an accelerator the guard reads its per-parameter tests back in one transfer
    (``first_false``); it must agree with the one-by-one loop the CPU keeps."""
    from lowband.engine.guard import ALL_FINITE, first_false
    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        indices = torch.randperm(20, generator=gen)[:n].tolist()
        oks = [torch.tensor(bool(b)) for b in torch.rand(n, generator=gen) > 0.3]
        bad = [i for i, ok in zip(indices, oks) if not ok]
        assert first_false(indices, oks) == (min(bad) if bad else ALL_FINITE)


# -- every collective, codec and algorithm keeps its input's device and dtype

#: codecs that run on ``meta`` (the others draw random numbers, which ``meta`` cannot)
META_CODECS = ("1bit", "2bit", "bf16", "fp16", "none", "topk")
CODEC_OPTIONS = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}}


def _codec_cases():
    from lowband.codecs import COMPRESSORS
    cases = [(name, META, torch.float32) for name in META_CODECS]
    return cases + [(name, torch.device("cpu"), dtype) for name in sorted(COMPRESSORS)
                    for dtype in (torch.float64, torch.bfloat16)]


@pytest.mark.parametrize("name, where, dtype", _codec_cases())
def test_every_codec_keeps_device_and_dtype(name, where, dtype):
    from lowband.codecs import ErrorFeedback, build_compressor
    x = torch.randn(64, 33).to(where, dtype)
    for ef in (False, True):
        codec = build_compressor(name, CODEC_OPTIONS.get(name, {}))
        codec = ErrorFeedback(codec) if ef else codec
        y = codec.decompress(*codec.compress(x, "t"))
        assert (y.device, y.dtype, y.shape) == (x.device, x.dtype, x.shape), (name, ef)


#: every lowband method past its warm-up within 5 steps
METHODS = {"ssgd": {}, "compressed": {"warmup_steps": 2},
           "cpsgd": {"warmup_steps": 2, "correction_period": 3, "adapt_period": True}, "lazy": {"lazy_layers": 1}}


def _float64(rank: int, world: int):
    """Collectives and methods on float64 tensors, with a parameter only rank 0 uses."""
    import lowband
    from lowband.comm.communicator import Communicator
    from lowband.codecs import make_compressor
    from lowband.comm.reducer import make_reducer
    from .training import PartlyUsed, batches, make_optimizer, train
    found = {}
    comm = Communicator()
    x = torch.arange(6, dtype=torch.float64) + rank
    gathered, swapped = torch.empty(12, dtype=torch.float64), torch.empty(6, dtype=torch.float64)
    comm.all_gather(gathered, x)
    comm.all_to_all(swapped, x)
    ints = torch.arange(4) * (rank + 1)
    comm.all_reduce(ints)
    comm.broadcast(x)
    reducer = make_reducer("allgather", comm, make_compressor("2bit", threshold=0.5))
    mean = x.clone()
    comm.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
    coded = reducer.start(x, "b").wait()
    reducer.close()
    found["collectives"] = [str(t.dtype) for t in (gathered, swapped, ints, x, mean, coded)]
    for name, options in METHODS.items():
        torch.manual_seed(0)
        model = PartlyUsed(rank).double()
        opt = make_optimizer("sgd", model)
        engine = lowband.distribute(model, opt, name, **options)
        train(model, opt, batches(rank, world), engine.step, 5, forward=lambda x: engine.module(x.double()))
        tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
        tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        tensors += list(getattr(engine.bound, "W", []))
        found[name] = sorted({str(t.dtype) for t in tensors})
        engine.close()
    return found


def test_collectives_and_methods_keep_a_float64_model_float64():
    """The compressed reducer averages in fp32 by contract (its result is fp32); everything
    else keeps float64: collectives, the pipeline's fp32-free jobs, and the parameters,
    gradients, optimizer state and global weights of every method (the gradient of a
    parameter that only another rank used arrives from the reducer and is cast)."""
    for found in run_distributed(_float64, 2):
        assert found.pop("collectives") == ["torch.float64"] * 2 + ["torch.int64"] + ["torch.float64"] * 2 + \
            ["torch.float32"]
        assert found == {name: ["torch.float64"] for name in METHODS}


def _reload_onto_meta(rank: int, world: int):
    """cpsgd's state, saved on the CPU mid-pipeline, loaded into an engine whose model is on
    ``meta``: what the algorithm keeps as loaded lands on the model's device."""
    import lowband
    from .training import SmallNet, batches, make_optimizer, train
    torch.manual_seed(0)
    model = SmallNet()
    opt = make_optimizer("sgd", model)
    engine = lowband.distribute(model, opt, "cpsgd", **METHODS["cpsgd"])
    train(model, opt, batches(rank, world), engine.step, 5, forward=engine.module)
    state = engine.state_dict()
    meta = SmallNet().to(META)
    again = lowband.distribute(meta, make_optimizer("sgd", meta), "cpsgd", **METHODS["cpsgd"])
    again.load_state_dict(state)
    bound = again.bound
    kept = [g for g in bound.in_flight.result() if g is not None] + [bound.in_flight.measure, bound._measure,
                                                                     bound._stats, *bound._prev_local, *bound.W]
    return sorted({str(t.device) for t in kept}), sorted(state["algorithm"])


def test_cpsgd_state_reloads_onto_the_model_device():
    devices, saved = run_distributed(_reload_onto_meta, 1)[0]
    assert {"in_flight", "in_flight_measure", "measure", "prev_local"} <= set(saved)
    assert devices == ["meta"]


def test_exact_divisor_is_a_device_tensor_off_the_cpu():
    """torch divides a CUDA tensor by a Python number as a multiplication by its reciprocal
    (not correctly rounded), so off the CPU the codecs divide by a 0-dim tensor on the
    tensor's device and dtype; on the CPU by the number itself (no allocation)."""
    assert exact_divisor(3.0, torch.zeros(2)) == 3.0
    d = exact_divisor(3.0, torch.zeros(2, device="meta"))
    assert isinstance(d, torch.Tensor) and d.dim() == 0 and d.device.type == "meta" and d.dtype == torch.float32
