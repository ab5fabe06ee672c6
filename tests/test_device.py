"""The device plumbing, checked on the CPU: --device resolution and its usage errors, the
backend choice, the rank's GPU, checkpointed state landing on the model's device (RNG state on
the CPU), and buffers following their input's device (``meta`` tensors)."""
from __future__ import annotations

import pytest
import torch

from lowband import checkpoint, cli, device
from lowband.compressors.base import scratch
from lowband.config import TrainConfig

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
    from lowband.guard import ALL_FINITE, first_false
    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        indices = torch.randperm(20, generator=gen)[:n].tolist()
        oks = [torch.tensor(bool(b)) for b in torch.rand(n, generator=gen) > 0.3]
        bad = [i for i, ok in zip(indices, oks) if not ok]
        assert first_false(indices, oks) == (min(bad) if bad else ALL_FINITE)

