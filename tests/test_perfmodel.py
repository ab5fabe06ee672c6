"""The performance model on cases with closed forms, its invariants, and `lowband plan`."""
from __future__ import annotations

import math
import random

import pytest

from lowband.algorithms.buckets import plan_buckets
from lowband.comm import wire
from lowband.perf.model import MODELS, Cluster, algorithm_defaults, estimate, lazy_split, pattern_steps
from lowband.perf.network import Network, parse_latency
from lowband.perf.profile import CodecInfo, ParamInfo, Profile, ProfileError, load_profile
from lowband.perf.simulate import Graph, Task, TokenBucket

GBIT = 1e9


def make_profile(sizes, backward, forward=0.01, optimizer=0.002, codec=None, shares=True, modules=None):
    """A synthetic profile: parameters of ``sizes`` elements (matrices), ready in reverse order."""
    params = [ParamInfo(name=f"p{i}", module=(modules[i] if modules else f"m{i}"), shape=[n, 1] if n > 1 else [1])
              for i, n in enumerate(sizes)]
    order = list(range(len(sizes)))[::-1]
    codecs = {"2bit": codec} if codec else {}
    return Profile(model="synthetic", batch_size=32, forward_s=forward, optimizer_s=optimizer, params=params,
                   ready_order=order, backward_s=list(backward), codecs=codecs, codec_shares_compute=shares)


def test_one_bucket_ring_allreduce_closed_form():
    nbytes, lat = 8e6, 5e-6
    net = Network(10 * GBIT, lat)
    for n in (2, 3, 8, 64):
        expected = 2 * (n - 1) / n * nbytes * 8 / (10 * GBIT) + 2 * (n - 1) * lat
        assert net.allreduce_s(nbytes, n) == pytest.approx(expected)
    # the same through the step model: one parameter, one bucket, nothing to overlap with (and
    # no finiteness exchange: the engine's check, a collective of its own, is tested below)
    numel = 2_000_000
    prof = make_profile([numel], [0.0], forward=0.0, optimizer=0.0)
    for n in (2, 8):
        est = estimate(prof, "ssgd", {"bucket_mb": 64, "nonfinite": "off"}, Cluster(n, net))
        bucket = 4 * numel + 4                      # gradients + one had-a-gradient flag
        assert est.step_s == pytest.approx(net.allreduce_s(bucket, n))
        assert est.bytes_sent == pytest.approx(wire.allreduce_bytes(bucket, n))


def test_other_collectives_closed_forms():
    net = Network(1 * GBIT, 1e-4)
    b, n = 1e6, 4
    assert net.allgather_s(b, n) == pytest.approx((n - 1) * b * 8 / GBIT + (n - 1) * 1e-4)
    assert net.alltoall_s(b, n) == pytest.approx((n - 1) / n * b * 8 / GBIT + (n - 1) * 1e-4)
    assert net.broadcast_s(b, n) == pytest.approx((n - 1) * b * 8 / GBIT + (n - 1) * 1e-4)
    # co-located parameter servers move what a ring all-reduce moves, in 2 rounds
    worker, server = wire.ps_link_bytes(b, b, n, n)
    assert worker == server == pytest.approx(wire.allreduce_bytes(b, n))
    assert net.ps_pushpull_s(b, b, n, n) == pytest.approx(net.transfer_s(wire.allreduce_bytes(b, n)) + 2e-4)
    # one server: its link carries every worker's push and pull
    assert wire.ps_link_bytes(b, b, n, 1)[1] == pytest.approx(2 * n * b)
    assert net.allreduce_s(b, 1) == 0.0


def test_without_communication_the_step_is_compute():
    prof = make_profile([1000, 200000, 5000], [0.003, 0.02, 0.001])
    net = Network(1 * GBIT, 1e-4)
    for name in MODELS:
        if name in ("ddp-fp16", "ddp-powersgd", "compressed", "cpsgd", "cp-diloco"):
            continue                      # they need codec measurements (covered below)
        est = estimate(prof, name, {}, Cluster(1, net))
        # DiLoCo's outer optimizer step once per sync (per fragment sync for the streaming variant)
        outer = prof.optimizer_s / MODELS[name].cycle(algorithm_defaults(name)) if "diloco" in name else 0.0
        assert est.step_s == pytest.approx(prof.compute_s + outer), name
    assert estimate(prof, "noop", {}, Cluster(64, net)).step_s == pytest.approx(prof.compute_s)


@pytest.mark.parametrize("seed", range(6))
def test_overlap_never_slower_than_compute_and_never_slower_than_no_overlap(seed):
    rng = random.Random(seed)
    k = rng.randint(1, 12)
    sizes = [rng.choice([10, 1000, 100_000, 600_000]) for _ in range(k)]
    prof = make_profile(sizes, [rng.uniform(0, 0.01) for _ in range(k)])
    net = Network(rng.choice([0.05, 1, 10]) * GBIT, rng.choice([0, 1e-5, 1e-3]))
    n = rng.choice([2, 4, 32])
    unchecked = {"nonfinite": "off"}         # the closed form below has no finiteness exchange
    on = estimate(prof, "ssgd", {"bucket_mb": rng.choice([0.1, 1, 25]), **unchecked}, Cluster(n, net))
    off = estimate(prof, "ssgd", {"bucket_mb": 1, "overlap": False, **unchecked}, Cluster(n, net))
    on1 = estimate(prof, "ssgd", {"bucket_mb": 1, **unchecked}, Cluster(n, net))
    assert on.step_s >= prof.compute_s - 1e-12
    assert on1.step_s <= off.step_s + 1e-12
    # without overlap the step is compute plus every bucket's all-reduce, back to back
    groups = plan_buckets(prof.sized_params(), range(k), 1 << 20)
    comm = sum(net.allreduce_s(sum(4 * sizes[i] for i in g) + 4 * len(g), n) for g in groups)
    assert off.step_s == pytest.approx(prof.compute_s + comm)


def _codec():
    return CodecInfo(encode_gbps=0.5, decode_gbps=2.0, payload_ratio=1 / 16)


@pytest.mark.parametrize("bandwidth", [0.02, 0.2, 10.0])
def test_cpsgd_steady_state_is_max_of_compute_and_codec_plus_comm(bandwidth):
    """One bucket, no correction, codec on a processor of its own: the depth-1 pipeline's
    period is max(compute, compress + communicate) (ALGORITHMS.md B.1.4)."""
    numel, n = 1_000_000, 4
    prof = make_profile([numel], [0.03], forward=0.015, optimizer=0.002, codec=_codec(), shares=False)
    net = Network(bandwidth * GBIT, 2e-5)
    opts = {"correction_period": None, "local_update": "sgd", "bucket_mb": 64, "collective": "two-stage"}
    est = estimate(prof, "cpsgd", opts, Cluster(n, net))
    cd, nb = prof.codecs["2bit"], 4.0 * numel
    chain = (cd.encode_s(nb, n) + net.alltoall_s(cd.payload(nb, n), n) + cd.decode_s(nb, n) + cd.encode_s(nb / n)
             + net.allgather_s(cd.payload(nb / n), n) + cd.decode_s(nb, n))
    compute = prof.compute_s + prof.optimizer_s          # + the local update (sgd: one optimizer-step cost)
    assert est.step_s == pytest.approx(max(compute, chain), rel=1e-9)
    # the synchronous compressed step pays for the same chain on its critical path
    sync = estimate(prof, "compressed", {"bucket_mb": 64, "collective": "two-stage"}, Cluster(n, net))
    assert sync.step_s == pytest.approx(prof.compute_s + chain, rel=1e-9)
    assert est.step_s <= sync.step_s + prof.optimizer_s


def test_cpsgd_charges_the_fused_pass_where_the_profile_measured_it():
    """Compute-bound (fast link, codec on its own processor): the step is forward + backward +
    the local-update work on the training thread: the profile's fused native pass when it
    measured one, else the global step plus the tentative step (LOCAL_UPDATE_COST)."""
    import dataclasses
    from lowband.perf.model import LOCAL_UPDATE_COST
    prof = make_profile([100_000], [0.03], forward=0.015, optimizer=0.002, codec=_codec(), shares=False)
    cluster = Cluster(2, Network(100 * GBIT, 0.0))
    opts = {"correction_period": None, "bucket_mb": 64}
    plain = estimate(prof, "cpsgd", opts, cluster)
    assert plain.step_s == pytest.approx(0.045 + 0.002 * (1 + LOCAL_UPDATE_COST["optimizer"]), rel=1e-6)
    fused = estimate(dataclasses.replace(prof, fused_update_s=0.0007), "cpsgd", opts, cluster)
    assert fused.step_s == pytest.approx(0.045 + 0.0007, rel=1e-6)
    # local_update="sgd" is not what the fused pass implements: it keeps the generic cost
    sgd = estimate(dataclasses.replace(prof, fused_update_s=0.0007), "cpsgd", {**opts, "local_update": "sgd"}, cluster)
    assert sgd.step_s == pytest.approx(0.045 + 0.002 * (1 + LOCAL_UPDATE_COST["sgd"]), rel=1e-6)


def test_cpsgd_burst_correction_costs_one_fp32_allreduce_per_period_when_network_bound():
    numel, n, k = 1_000_000, 4, 5
    prof = make_profile([numel], [0.0], forward=0.0, optimizer=0.0, codec=CodecInfo(1e6, 1e6, payload_ratio=1 / 16),
                        shares=False)
    net = Network(0.1 * GBIT, 0.0)
    two = {"correction_period": k, "bucket_mb": 64, "collective": "two-stage"}
    est = estimate(prof, "cpsgd", {**two, "correction": "burst"}, Cluster(n, net))
    nb = 4.0 * numel
    compressed = net.alltoall_s(nb / 16, n) + net.allgather_s(nb / 16 / n, n)
    assert est.step_s == pytest.approx(((k - 1) * compressed + net.allreduce_s(nb, n)) / k, rel=1e-3)
    spread = estimate(prof, "cpsgd", {**two, "correction": "spread"}, Cluster(n, net))
    # the same fp32 bytes per period, plus the codes of each step's exact share, which travel
    # as zeros (a section's layout is fixed)
    from lowband.comm.wire import allgather_bytes, alltoall_bytes
    codes = alltoall_bytes(nb / 16, n) + allgather_bytes(nb / 16 / n, n)
    assert spread.bytes_sent == pytest.approx(est.bytes_sent + codes / k, rel=1e-3)


@pytest.mark.parametrize("n, collective", [(2, "allgather"), (4, "allgather"), (4, "two-stage")])
def test_compressed_sends_1d_parameters_inside_the_bucket_message(n, collective):
    """One collective per bucket: every element's code plus the 1-D parameters in fp32 in the
    same message; at 4 ranks allgather carries them too (few bytes), an fp32 share would not."""
    import dataclasses
    matrix, vector = 1_000_000, 5_000
    prof = make_profile([matrix, 1], [0.0, 0.0], forward=0.0, optimizer=0.0,
                        codec=CodecInfo(1e15, 1e15, payload_ratio=1 / 16), shares=False)
    prof.params[1] = dataclasses.replace(prof.params[1], shape=[vector])
    net = Network(0.1 * GBIT, 1e-3)
    est = estimate(prof, "compressed", {"bucket_mb": 64, "collective": collective}, Cluster(n, net))
    nb, raw = 4.0 * (matrix + vector), 4.0 * vector
    if collective == "allgather":
        wire_bytes, seconds = wire.allgather_bytes(nb / 16 + raw, n), net.allgather_s(nb / 16 + raw, n)
    else:
        wire_bytes = wire.alltoall_bytes(nb / 16 + raw, n) + wire.allgather_bytes((nb / 16 + raw) / n, n)
        seconds = net.alltoall_s(nb / 16 + raw, n) + net.allgather_s((nb / 16 + raw) / n, n)
    assert est.bytes_sent == pytest.approx(wire_bytes, rel=1e-6)
    assert est.step_s == pytest.approx(seconds, rel=1e-3)


def test_ddp_powersgd_charges_the_hook_phases_the_profile_measured():
    """With the hook's own three phases in the profile and a free network, the step is compute
    plus the three phases, in sequence after backward."""
    import dataclasses
    from lowband.perf.profile import measure_powersgd_hook
    phases = measure_powersgd_hook([(64, 32), (64,), (16, 8, 3, 3)], rank=2, reps=3)
    assert len(phases) == 3 and min(phases) > 0
    prof = make_profile([2048, 1], [0.01, 0.0], forward=0.005, optimizer=0.001, shares=True)
    prof.params[0] = dataclasses.replace(prof.params[0], shape=[64, 32])
    prof = dataclasses.replace(prof, powersgd_hook_s={"2": [0.003, 0.002, 0.001]})
    est = estimate(prof, "ddp-powersgd", {}, Cluster(2, Network(1e15, 0.0)))
    assert est.step_s == pytest.approx(0.005 + 0.01 + 0.006 + 0.001, rel=1e-6)
    with pytest.raises(Exception, match="powersgd_hook_s"):
        dataclasses.replace(prof, powersgd_hook_s={"2": [0.1, -1.0, 0.0]}).check()


def test_ddp_peers_pay_the_engine_overhead_the_profile_measured_beyond_what_is_modelled():
    """``engine_overhead_s`` (measured in one process against noop) is charged once per step,
    minus the parts the model already charges (the fp16 casts, PowerSGD's three phases)."""
    import dataclasses
    free = Cluster(2, Network(1e15, 0.0))
    prof = make_profile([2048, 1], [0.01, 0.0], forward=0.005, optimizer=0.001, codec=_codec())
    prof.params[0] = dataclasses.replace(prof.params[0], shape=[64, 32])
    prof = dataclasses.replace(prof, codecs={**prof.codecs, "fp16": _codec()}, powersgd_hook_s={"2": [0.003, 0.002, 0.001]})
    base = {k: estimate(prof, k, {}, free).step_s for k in ("ddp", "ddp-fp16", "ddp-powersgd")}
    assert base["ddp"] == pytest.approx(prof.compute_s)
    over = dataclasses.replace(prof, engine_overhead_s={"ddp": 0.004, "ddp-fp16": 1e-9, "ddp-powersgd": 0.010})
    assert estimate(over, "ddp", {}, free).step_s == pytest.approx(base["ddp"] + 0.004)
    assert estimate(over, "ddp-fp16", {}, free).step_s == pytest.approx(base["ddp-fp16"])   # less than its casts
    assert estimate(over, "ddp-powersgd", {}, free).step_s == pytest.approx(base["ddp-powersgd"] + 0.010 - 0.006)
    assert estimate(over, "ssgd", {}, free).step_s == pytest.approx(estimate(prof, "ssgd", {}, free).step_s)
    with pytest.raises(Exception, match="engine_overhead_s"):
        dataclasses.replace(prof, engine_overhead_s={"ddp": -1.0}).check()


def test_engine_overhead_is_measured_against_noop_in_one_process():
    from lowband.perf.profile import measure_engine_overhead
    got, pipeline = measure_engine_overhead("cnn", 8, algorithms=("ddp", "ddp-powersgd"), steps=3, rounds=1,
                                            warmup=12, pipelines=("compressed", "cpsgd"))
    assert set(got) == {"ddp", "ddp-powersgd"} and all(x >= 0 for x in got.values())
    # each pipeline thread ran its jobs (encode, the collective's call, decode) on the CPU
    assert set(pipeline) == {"compressed", "cpsgd"} and all(x > 0 for x in pipeline.values())


def test_streaming_diloco_syncs_the_codes_fragments_in_turn_and_hides_them_with_a_delay():
    """Fragments by lowband's rule (one large layer: one large fragment); with no delay each
    fragment's all-reduces (one per parameter, as torchft 0.2.0 sends them) are on the critical
    path once per rotation of ``sync_every`` steps, behind a quorum and before a commit vote
    (one round trip each); with a delay of one step and enough compute the all-reduces hide
    behind the next step, the quorum and the vote do not."""
    from lowband.algorithms.peers.diloco import split_fragments
    from lowband.perf.model import fragment_groups
    prof = make_profile([1_000_000, 1000, 1000], [0.001, 0.001, 0.001], forward=0.001, optimizer=0.0)
    assert fragment_groups(prof, 2) == split_fragments(prof.sized_params(), 2) == [[0], [1, 2]]
    net = Network(1 * GBIT, 1e-5)
    n = 2
    opts = {"sync_every": 16, "fragments": 2, "fragment_sync_delay": 0}
    est = estimate(prof, "streaming-diloco", opts, Cluster(n, net))
    barriers = 2 * 2 * (2 * net.latency_s)       # a quorum and a vote per fragment, a round trip each
    comm = net.allreduce_s(4e6, n) + 2 * net.allreduce_s(4e3, n)       # both fragments, once per 16 steps
    assert est.step_s == pytest.approx(prof.compute_s + (comm + barriers) / 16)
    assert est.bytes_sent == pytest.approx((wire.allreduce_bytes(4e6, n) + 2 * wire.allreduce_bytes(4e3, n)) / 16)
    slow = make_profile([1_000_000, 1000, 1000], [0.02, 0.02, 0.02], forward=0.02, optimizer=0.0)
    hidden = estimate(slow, "streaming-diloco", {**opts, "fragment_sync_delay": 1}, Cluster(n, net))
    assert hidden.step_s == pytest.approx(slow.compute_s + barriers / 16)   # 32 ms of wire behind an 80 ms step
    # the ranks meet at each quorum and vote, not at each parameter's call behind the quorum
    met = estimate(prof, "streaming-diloco", opts, Cluster(n, net, sync_s=1e-3))
    assert met.step_s == pytest.approx(est.step_s + 2 * 2 * 1e-3 / 16)


def test_codec_sharing_the_processor_is_never_faster():
    prof = make_profile([300_000, 300_000], [0.01, 0.01], codec=_codec(), shares=True)
    net = Network(1 * GBIT, 1e-5)
    for name in ("compressed", "cpsgd"):
        shared = estimate(prof, name, {}, Cluster(4, net))
        own = estimate(prof, name, {}, Cluster(4, net, codec_shares_compute=False))
        assert shared.step_s >= own.step_s - 1e-12


def test_lazy_syncs_every_tau_steps_and_large_tau_approaches_regular_only():
    sizes = [5000, 5000, 400_000, 100]
    prof = make_profile(sizes, [0.002, 0.002, 0.01, 0.0])
    net = Network(0.1 * GBIT, 1e-4)
    tau1 = estimate(prof, "lazy", {"tau": 1, "lazy_layers": 2}, Cluster(4, net))
    tau8 = estimate(prof, "lazy", {"tau": 8, "lazy_layers": 2}, Cluster(4, net))
    ssgd = estimate(prof, "ssgd", {}, Cluster(4, net))
    assert tau8.step_s <= tau1.step_s
    assert tau8.bytes_sent < tau1.bytes_sent
    lazy_bytes = 4 * (5000 + 5000) + 4 * 5000         # accumulators + the probe's latest gradient
    assert tau1.bytes_sent - tau8.bytes_sent == pytest.approx(wire.allreduce_bytes(lazy_bytes, 4) * (1 - 1 / 8))
    assert tau8.step_s <= ssgd.step_s + 1e-12


def test_lazy_split_mirrors_the_algorithm_rule():
    import torch
    from lowband.algorithms.lazy import DEFAULT_LAZY_LAYERS, input_side_layers
    from lowband.app.models import make_model
    prof = load_profile("resnet50-v100")
    lazy, probe = lazy_split(prof, None)
    modules = list(dict.fromkeys(prof.params[i].module for i in lazy))
    assert len(modules) == DEFAULT_LAZY_LAYERS and modules[0] == "conv1"
    assert probe and all(prof.params[i].module == modules[-1] for i in probe)
    model = make_model("resnet20")
    layers = input_side_layers(model)
    from lowband.perf.profile import ParamInfo as P
    from lowband.algorithms.lazy import NORM_LAYERS
    owner = {id(p): (m, isinstance(mod, NORM_LAYERS)) for m, mod in model.named_modules() for p in mod.parameters(False)}
    params = [P(n, owner[id(p)][0], list(p.shape), 4, owner[id(p)][1]) for n, p in model.named_parameters()]
    fake = make_profile([p.numel for p in params], [0.0] * len(params))
    fake.params = params
    lazy, _ = lazy_split(fake, None)
    want = [name for name, _ in layers[:min(DEFAULT_LAZY_LAYERS, len(layers) // 2)]]
    assert list(dict.fromkeys(params[i].module for i in lazy)) == want
    assert torch.is_tensor(next(model.parameters()))


def test_periodic_average_cost_is_amortised():
    prof = make_profile([250_000], [0.01])
    net = Network(0.1 * GBIT, 0.0)
    est = estimate(prof, "localsgd", {"period": 4}, Cluster(2, net))
    assert est.step_s == pytest.approx(prof.compute_s + net.allreduce_s(1e6, 2) / 4)


def test_simulator_resources_are_serial_and_markers_free():
    g = Graph()
    a = g.add("a", "net", 1.0)
    b = g.add("b", "net", 1.0)                 # same resource: after a
    c = g.add("c", "compute", 0.5)             # another resource: in parallel
    m = g.marker("m", [b, c])
    d = g.add("d", "compute", 0.25, [m])
    assert g.run() == pytest.approx(2.25)
    assert g.tasks[b].start == pytest.approx(1.0) and g.tasks[c].start == 0.0 and g.tasks[d].start == 2.0
    with pytest.raises(ValueError):
        g.add("bad", None, -1.0)
    assert a == 0


def test_bundled_profiles_load_and_state_their_source():
    for name in ("resnet50-v100", "resnet50-knl", "cnn-2core"):
        p = load_profile(name)
        assert p.source and p.compute_s > 0
    r50 = load_profile("resnet50-v100")
    assert sum(p.numel for p in r50.params) == 25_557_032
    assert r50.batch_size / r50.compute_s == pytest.approx(367.0)
    assert r50.scaled(56).compute_s == pytest.approx((r50.compute_s - r50.optimizer_s) / 2 + r50.optimizer_s)


def test_measured_profile_round_trips(tmp_path):
    from lowband.perf.profile import measure
    prof = measure("mlp", batch_size=8, codecs=["1bit"], reps=2)
    assert sorted(prof.ready_order) == list(range(len(prof.params)))
    assert prof.ready_order[0] == len(prof.params) - 1     # the output layer's bias is ready first
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = load_profile(str(path))
    assert back.params == prof.params and back.codecs["1bit"].payload_ratio == pytest.approx(1 / 32)
    from lowband import _native as kernels
    if kernels.library() is not None:      # plain SGD on CPU: the fused pass is what cpsgd runs
        assert back.fused_update_s is not None and 0 < back.fused_update_s < prof.optimizer_s * 5
    assert back.codecs["1bit"].encode_gbps > 0 and "bucket-level" in back.codecs["1bit"].note  # native: as the collectives run it
    # PyTorch's PowerSGD hook, by rank: three phases, more work at a higher rank
    assert sorted(back.powersgd_hook_s) == ["1", "2", "4"] and back.powersgd_hook_s == prof.powersgd_hook_s
    # the peers' engine overhead against noop (torchft's only where it is installed)
    assert {"ddp", "ddp-fp16", "ddp-powersgd"} <= set(back.engine_overhead_s) and back.engine_overhead_s == prof.engine_overhead_s


def test_language_model_profiles_with_byte_batches():
    """The profile feeds each model the batch it trains on (a language model: byte ids)."""
    from lowband.perf.profile import measure_compute
    c = measure_compute("gpt", batch_size=2, reps=1, warmup=0)
    assert c["forward_s"] > 0 and sum(p.numel * p.element_size for p in c["params"]) > 4_000_000
    # the tied embedding appears once, as in the training runs
    names = [p.name for p in c["params"]]
    assert names.count("tok.weight") == 1 and "head.weight" not in names


def test_parse_bytes():
    from lowband.perf.network import parse_bytes
    assert parse_bytes("96kb") == 96 * 1024 and parse_bytes("98304b") == 98304 and parse_bytes("2mb") == 2 << 20
    assert parse_bytes("0") == 0.0 and parse_bytes(" 10 ") == 10.0


def test_parse_latency():
    assert parse_latency("5us") == pytest.approx(5e-6)
    assert parse_latency("0.2ms") == pytest.approx(2e-4)
    assert parse_latency("0") == 0.0
    with pytest.raises(ValueError):
        parse_latency("fast")


def test_plan_cli_prints_a_table_and_plots(tmp_path, capsys):
    from lowband.app.cli import main
    out = tmp_path / "speedup.png"
    rc = main(["plan", "--profile", "cnn-2core", "--workers", "2,8", "--bandwidth", "1gbit", "--latency", "50us",
               "--algorithms", "ssgd,cpsgd:correction_period=10,lazy:tau=4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "| cpsgd:correction_period=10 | 8 |" in text and "speedup" in text
    # a tbf-shaped 50 Mbit/s link: compressed's small message mostly fits the bucket
    plain = ["plan", "--profile", "cnn-2core", "--workers", "2", "--bandwidth", "50mbit", "--algorithms", "compressed"]
    step = {}
    for burst in ("0", "96kb"):
        assert main([*plain, "--burst", burst]) == 0
        text = capsys.readouterr().out
        step[burst] = float(text.split("| compressed | 2 | ")[1].split(" |")[0])
        assert ("burst 96kb" in text) == (burst != "0")
    assert step["96kb"] < step["0"]


def test_plan_says_what_cp_diloco_auto_chose(capsys):
    """The plan's table names the H (and apply step) cp-diloco's ``sync_every="auto"`` resolves
    to on each link, as :func:`resolved_options` does; a fixed H chooses nothing; a table
    without such a row has no column for it."""
    from lowband.app.cli import main
    from lowband.netem import parse_rate
    from lowband.perf.model import resolved_options
    prof = load_profile("cnn-2core")
    for rate in ("20mbit", "1gbit"):
        assert main(["plan", "--profile", "cnn-2core", "--workers", "2", "--bandwidth", rate,
                     "--algorithms", "cp-diloco,cp-diloco:sync_every=8"]) == 0
        text = capsys.readouterr().out
        o = resolved_options(prof, "cp-diloco", {}, Cluster(2, Network(parse_rate(rate))))
        row = next(line for line in text.splitlines() if line.startswith("| cp-diloco | 2 |"))
        assert row.endswith(f" H = {o['sync_every']}, apply_after = {o['apply_after']} |"), (row, o)
        assert next(line for line in text.splitlines() if line.startswith("| cp-diloco:sync_every=8 |")).endswith(" - |")
    assert main(["plan", "--profile", "cnn-2core", "--workers", "2", "--bandwidth", "20mbit",
                 "--algorithms", "compressed"]) == 0
    assert "auto chose" not in capsys.readouterr().out


@pytest.mark.parametrize("args, expected", [
    (["--bandwidth", "fast"], "invalid rate 'fast'"),
    (["--bandwidth", "1gbit", "--latency", "soon"], "invalid latency 'soon'"),
    (["--bandwidth", "1gbit", "--burst", "lots"], "invalid size 'lots'"),
    (["--bandwidth", "1gbit", "--burst=-1kb"], "invalid size '-1kb': must be >= 0"),
    (["--bandwidth", "1gbit", "--algorithms", "magic"], "no performance model for algorithm 'magic'"),
    (["--bandwidth", "1gbit", "--algorithms", "ssgd:no_such_knob=1"], "bad options for algorithm 'ssgd'"),
    (["--bandwidth", "1gbit", "--workers", "0"], "--workers values must be >= 1"),
    (["--bandwidth", "1gbit", "--profile", "nowhere.json"], "is neither a file nor a bundled profile"),
    (["--bandwidth", "1gbit", "--algorithms", "ddp-fp16", "--profile", "resnet50-knl"], "has no measurement of codec"),
    (["--bandwidth", "1gbit", "--no-such-flag"], "unrecognized arguments"),
])
def test_plan_cli_bad_input_is_one_line(args, expected, capsys):
    from lowband.app.cli import main
    argv = ["plan", *args]
    if "--profile" not in args:
        argv += ["--profile", "cnn-2core"]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert expected in err[0] and "Traceback" not in err[0]


def test_every_registry_algorithm_has_a_model():
    from lowband.algorithms import ALGORITHMS
    assert set(ALGORITHMS) <= set(MODELS)
    assert all(math.isfinite(estimate(load_profile("cnn-2core"), a, {}, Cluster(2, Network(GBIT))).step_s)
               for a in ALGORITHMS)


def test_communication_cpu_cost_competes_with_compute_only_when_given():
    prof = make_profile([200_000, 200_000], [0.01, 0.01])
    net = Network(1 * GBIT, 1e-5)
    free = estimate(prof, "ssgd", {}, Cluster(4, net))
    busy = estimate(prof, "ssgd", {}, Cluster(4, net, comm_cpu_s_per_byte=2e-9))
    assert busy.step_s > free.step_s
    assert busy.step_s <= free.step_s + 2e-9 * busy.bytes_sent + 1e-12   # at most all of it exposed
    assert busy.bytes_sent == pytest.approx(free.bytes_sent)


def test_synchronization_cost_is_paid_once_per_collective_and_only_where_exposed():
    net = Network(10 * GBIT, 5e-6)
    sync = 3e-3
    # one bucket after backward: step = allreduce + one synchronization
    prof = make_profile([2_000_000], [0.0], forward=0.0, optimizer=0.0)
    plain = estimate(prof, "ssgd", {"bucket_mb": 64}, Cluster(4, net))
    synced = estimate(prof, "ssgd", {"bucket_mb": 64}, Cluster(4, net, sync_s=sync))
    assert synced.step_s == pytest.approx(plain.step_s + sync)
    assert synced.bytes_sent == pytest.approx(plain.bytes_sent)
    # ddp-powersgd: three collectives after backward, P's and Q's one after another
    # (the uncompressed tensors' all-reduce runs first, beside the P = MQ phase)
    import dataclasses
    hook = make_profile([2048], [0.0], forward=0.0, optimizer=0.0)
    hook.params[0] = dataclasses.replace(hook.params[0], shape=[64, 32])
    hook = dataclasses.replace(hook, powersgd_hook_s={"2": [0.0, 0.0, 0.0]})
    ps = estimate(hook, "ddp-powersgd", {}, Cluster(4, net))
    assert estimate(hook, "ddp-powersgd", {}, Cluster(4, net, sync_s=sync)).step_s == \
        pytest.approx(ps.step_s + 3 * sync)
    # an early bucket's collective hides behind the rest of backward, its synchronization too
    prof2 = make_profile([1000, 2_000_000], [0.0, 0.05], forward=0.0, optimizer=0.0)  # big one ready first
    hidden = estimate(prof2, "ssgd", {"bucket_mb": 1}, Cluster(2, net))
    with_sync = estimate(prof2, "ssgd", {"bucket_mb": 1}, Cluster(2, net, sync_s=sync))
    assert with_sync.step_s == pytest.approx(hidden.step_s + sync)   # only the last bucket's is exposed
    # one worker: nobody to meet
    assert estimate(prof, "ssgd", {}, Cluster(1, net, sync_s=sync)).step_s == pytest.approx(prof.compute_s)
    with pytest.raises(ValueError, match="sync_s"):
        Cluster(2, net, sync_s=-1.0)


def test_the_collective_that_ends_a_step_waits_for_the_later_rank_unless_its_bytes_take_longer():
    """``step_sync_s``: the collective launched as backward ends completes no earlier than
    that long after its launch. A latency-bound one shows it whole; a bandwidth-bound one
    absorbs it; one worker has nobody to wait for; it never makes a step faster."""
    net, lag = Network(10 * GBIT, 5e-6), 4e-3
    small = make_profile([1000], [0.01], forward=0.005, optimizer=0.001)
    met = estimate(small, "ssgd", {"bucket_mb": 64}, Cluster(2, net, step_sync_s=lag))
    assert met.step_s == pytest.approx(0.005 + 0.01 + lag + 0.001)
    assert estimate(small, "ssgd", {"bucket_mb": 64}, Cluster(1, net, step_sync_s=lag)).step_s == \
        pytest.approx(small.compute_s)
    big = make_profile([20_000_000], [0.01], forward=0.005, optimizer=0.001)     # 80 MB: 128 ms at 10 Gbit
    assert estimate(big, "ssgd", {"bucket_mb": 128}, Cluster(2, net, step_sync_s=lag)).step_s == \
        pytest.approx(estimate(big, "ssgd", {"bucket_mb": 128}, Cluster(2, net)).step_s)
    # PowerSGD's chain starts with the uncompressed tensors' all-reduce: on a free network with
    # free phases the step is compute plus the lag, and P's all-reduce waits for it
    import dataclasses
    hook = make_profile([2048, 8], [0.01, 0.0], forward=0.005, optimizer=0.001)
    hook.params[0] = dataclasses.replace(hook.params[0], shape=[64, 32])
    hook = dataclasses.replace(hook, powersgd_hook_s={"2": [0.0, 0.0, 0.0]})
    free = Network(1e15, 0.0)
    assert estimate(hook, "ddp-powersgd", {}, Cluster(2, free, step_sync_s=lag)).step_s == \
        pytest.approx(hook.compute_s + lag)
    # every per-step algorithm: never faster with the lag, and a small model shows it
    import dataclasses as dc
    coded = make_profile([1000, 8], [0.01, 0.0], forward=0.005, optimizer=0.001, codec=_codec())
    coded = dc.replace(coded, codecs={**coded.codecs, "fp16": CodecInfo(encode_gbps=1.0, decode_gbps=1.0,
                                                                        payload_ratio=0.5)},
                       powersgd_hook_s={"2": [1e-4, 1e-4, 1e-4]})
    for name in ("ssgd", "ddp", "ddp-fp16", "ddp-powersgd", "lazy", "compressed", "cpsgd"):
        plain = estimate(coded, name, {}, Cluster(2, net)).step_s
        lagged = estimate(coded, name, {}, Cluster(2, net, step_sync_s=lag)).step_s
        assert lagged >= plain - 1e-12, name
        if name != "cpsgd":            # CP-SGD's step t meets while step t+1 computes: hidden here
            assert lagged > plain, name
    assert estimate(coded, "cpsgd", {}, Cluster(2, net, step_sync_s=lag)).step_s == \
        pytest.approx(estimate(coded, "cpsgd", {}, Cluster(2, net)).step_s)
    with pytest.raises(ValueError, match="step_sync_s"):
        Cluster(2, net, step_sync_s=-1.0)


def test_a_hooks_chained_all_reduces_take_at_least_the_chains_measured_time():
    """``chained_s``: PowerSGD's P and Q all-reduces (links 1 and 2 of the hook's callback chain)
    complete no earlier than ``chained_s[0]`` / ``chained_s[1]`` after their launch. On a free
    network with free phases each adds its floor whole; one worker meets nobody; an all-reduce
    whose bytes take longer than the floor absorbs it; a short tuple repeats its last entry."""
    import dataclasses
    hook = make_profile([2048, 8], [0.01, 0.0], forward=0.005, optimizer=0.001)
    hook.params[0] = dataclasses.replace(hook.params[0], shape=[64, 32])
    hook = dataclasses.replace(hook, powersgd_hook_s={"2": [0.0, 0.0, 0.0]})
    free = Network(1e15, 0.0)
    off = {"nonfinite": "off"}
    p_floor, q_floor = 0.003, 0.005
    assert estimate(hook, "ddp-powersgd", off, Cluster(2, free, chained_s=(p_floor, q_floor))).step_s == \
        pytest.approx(hook.compute_s + p_floor + q_floor)
    assert estimate(hook, "ddp-powersgd", off, Cluster(2, free, chained_s=(p_floor,))).step_s == \
        pytest.approx(hook.compute_s + 2 * p_floor)
    assert estimate(hook, "ddp-powersgd", off, Cluster(1, free, chained_s=(p_floor, q_floor))).step_s == \
        pytest.approx(hook.compute_s)
    # P: 64 x 2 fp32 = 512 B, Q: 32 x 2 = 256 B; at 1 kB/s (8000 bit/s) a 2-rank ring moves 2(N-1)/N x
    # the bytes: 0.512 s and 0.256 s, both above the floors, which then change nothing
    slow = Network(8000.0, 0.0)
    assert estimate(hook, "ddp-powersgd", off, Cluster(2, slow, chained_s=(p_floor, q_floor))).step_s == \
        pytest.approx(estimate(hook, "ddp-powersgd", off, Cluster(2, slow)).step_s)
    # other algorithms have no callback chain
    for name in ("ssgd", "ddp", "lazy"):
        assert estimate(hook, name, off, Cluster(2, free, chained_s=(1.0, 1.0))).step_s == \
            pytest.approx(estimate(hook, name, off, Cluster(2, free)).step_s), name
    with pytest.raises(ValueError, match="chained_s"):
        Cluster(2, free, chained_s=(0.001, -1.0))


def test_synchronous_algorithms_pay_the_engines_finiteness_exchange():
    """Under ``nonfinite="raise"`` (the default) a synchronous algorithm's step has one more
    collective, the engine's check (an int64 per rank), before the optimizer: after DDP's
    reduction (which ends inside backward), so in series; beside S-SGD's in-flight buckets (it
    has a group of its own), so it shows only where it outlasts them. Algorithms that defer the
    check (localsgd, noop) or carry it in their messages (compressed, cpsgd) do not pay it."""
    net = Network(10 * GBIT, 1e-4)
    prof = make_profile([1000], [0.01], forward=0.005, optimizer=0.001, codec=_codec())
    tiny = net.allreduce_s(8 * 2, 2)
    for name in ("ddp",):
        off = estimate(prof, name, {"nonfinite": "off"}, Cluster(2, net)).step_s
        assert estimate(prof, name, {}, Cluster(2, net)).step_s == pytest.approx(off + tiny)
        assert estimate(prof, name, {"nonfinite": "skip"}, Cluster(2, net)).step_s == pytest.approx(off + tiny)
        # a measured cost replaces the network's
        assert estimate(prof, name, {}, Cluster(2, net, exchange_s=0.004)).step_s == pytest.approx(off + 0.004)
    for name in ("ssgd", "lazy"):
        off = estimate(prof, name, {"nonfinite": "off"}, Cluster(2, net)).step_s
        assert estimate(prof, name, {}, Cluster(2, net, exchange_s=1e-6)).step_s == pytest.approx(off), name
        assert estimate(prof, name, {}, Cluster(2, net, exchange_s=0.05)).step_s == \
            pytest.approx(0.005 + 0.01 + 0.05 + 0.001), name
    for name in ("ssgd", "ddp", "lazy"):
        assert estimate(prof, name, {}, Cluster(1, net, exchange_s=0.05)).step_s == pytest.approx(prof.compute_s)
    for name in ("noop", "localsgd", "compressed", "cpsgd"):
        assert estimate(prof, name, {}, Cluster(2, net, exchange_s=0.004)).step_s == \
            pytest.approx(estimate(prof, name, {"nonfinite": "off"}, Cluster(2, net)).step_s), name
    with pytest.raises(ValueError, match="exchange_s"):
        Cluster(2, net, exchange_s=-1.0)


@pytest.mark.parametrize("args, expected", [
    (["--model", "vgg99", "--out", "x.json"], "unknown model 'vgg99'"),
    (["--model", "cnn", "--out", "x.json", "--codecs", "3bit"], "unknown compressor(s) ['3bit']"),
    (["--model", "cnn"], "the following arguments are required: --out"),
])
def test_profile_cli_bad_input_is_one_line(args, expected, capsys, tmp_path):
    from lowband.app.cli import main
    rc = main(["profile", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expected in err[0], err


def test_token_bucket_lets_a_burst_through_at_line_speed_then_the_rate():
    """tc tbf's bucket: after an idle period up to ``burst`` bytes pass at once; what follows
    back to back pays the rate; an idle gap refills the bucket at the nominal rate."""
    rate, burst, lat = 50e6, 96 * 1024, 1e-3          # 50 Mbit/s, 96 KB, 1 ms per message
    net = Network(rate, lat, burst_bytes=burst)
    per_byte = 8 / rate

    def step(n: int, nbytes: float, gap: float = 0.0) -> list[float]:
        g = Graph()
        g.shapers["net"] = TokenBucket(burst, rate / 8, per_byte)
        prev = None
        for i in range(n):
            delay = g.add(f"gap{i}", None, gap if i else 0.0, [prev])
            prev = g.add(f"m{i}", "net", net.allgather_s(nbytes, 2), [delay])
            g.tasks[prev].shaped_bytes = wire.allgather_bytes(nbytes, 2)
        g.run()
        return [t.end - t.start for t in g.tasks if t.name.startswith("m")]

    small = step(1, 40e3)                    # fits: only the message's latency remains
    assert small == [pytest.approx(lat)]
    big = step(1, 150e3)                     # 96 KB early, the rest at the rate
    assert big == [pytest.approx(lat + (150e3 - burst) * per_byte)]
    two = step(2, 60e3)                      # back to back: the second finds 36 KB left
    assert two == [pytest.approx(lat), pytest.approx(lat + (60e3 - (burst - 60e3)) * per_byte)]
    refilled = step(2, 60e3, gap=0.1)        # 100 ms at 6.25 MB/s refills the whole bucket
    assert refilled == [pytest.approx(lat), pytest.approx(lat)]
    # the simulation is repeatable: the bucket starts full on every run
    g = Graph()
    g.shapers["net"] = TokenBucket(burst, rate / 8, per_byte)
    g.tasks.append(Task("m", "net", 1.0, []))
    g.tasks[0].shaped_bytes = 1e9
    assert g.run() == pytest.approx(g.run())
    # an empty start (steady-state simulations): nothing passes early until it has refilled
    g = Graph()
    g.shapers["net"] = TokenBucket(burst, rate / 8, per_byte, start_full=False)
    g.tasks.append(Task("m", "net", 1.0, []))
    g.tasks[0].shaped_bytes = 1e9
    assert g.run() == pytest.approx(1.0)


def test_pattern_steps_take_the_codes_defaults():
    """The period of each algorithm's step pattern, with the knobs it is not given at the
    registry's defaults (what estimate simulates and the validation measures in blocks of):
    CP-SGD's spread correction sends the same bytes every step, a burst one makes one step in k
    an fp32 step; DiLoCo syncs every 32 steps by default (the validation once took its raw
    options and measured it in 50-step blocks, the model's fallback)."""
    assert pattern_steps("cpsgd", {}) == 1
    assert pattern_steps("cpsgd", {"correction": "spread", "correction_period": 50}) == 1
    assert pattern_steps("cpsgd", {"correction": "burst", "correction_period": 5}) == 5
    assert pattern_steps("cpsgd", {"correction": "burst"}) == algorithm_defaults("cpsgd")["correction_period"] == 80
    assert pattern_steps("localsgd", {"period": 8}) == 8
    assert pattern_steps("diloco", {}) == algorithm_defaults("diloco")["sync_every"] == 32
    assert pattern_steps("lazy", {"tau": 3.2}) == 4
    assert pattern_steps("ssgd", {}) == 1
    with pytest.raises(ValueError):
        pattern_steps("nope", {})


@pytest.mark.parametrize("rate, burst", [("1gbit", None), ("200mbit", None), ("50mbit", None), ("20mbit", None),
                                         ("50mbit", 1e6), ("20mbit", 1e6)])
def test_estimate_reads_the_steady_state_after_its_lead_in(rate, burst):
    """Every modelled algorithm's default estimate equals one measured after a 60-step lead-in,
    on the benchmark's paced links (a bucket of a fraction of a millisecond) and behind a deep (1 MB)
    bucket: the lead-in outlasts a depth-1 pipeline filling its backlog (cpsgd with no
    correction, cnn at 50 Mbit/s: 14% fast with the old 2-step lead-in), and the token bucket
    starts empty (a full 1 MB bucket read compressed at 20 Mbit/s 69% fast after 8 steps)."""
    from lowband.netem import paced, parse_rate
    prof = load_profile("cnn-2core")
    bits = parse_rate(rate)
    net = Network(bits, 1e-4, 0.95, burst if burst else float(paced(bits).bucket_bytes))
    for n in (2, 4):
        for name in MODELS:
            variants = [{}, {"correction_period": None}, {"correction": "burst", "correction_period": 5}] \
                if name == "cpsgd" else [{}]
            for opts in variants:
                short = estimate(prof, name, opts, Cluster(n, net))
                # cp-diloco's pipeline is one 16-step round deep: 10 rounds
                long = estimate(prof, name, opts, Cluster(n, net), lead_in=160 if name == "cp-diloco" else 60)
                assert short.step_s == pytest.approx(long.step_s, rel=2e-3), (name, opts, n)


def test_the_step_model_applies_the_links_bucket_and_zero_burst_is_the_plain_rate():
    numel = 30_000                               # a 120 KB gradient: bigger than the bucket
    prof = make_profile([numel], [0.02], forward=0.01, optimizer=0.0)
    plain, tbf = Network(50e6, 1e-4), Network(50e6, 1e-4, burst_bytes=96 * 1024)
    est0 = estimate(prof, "ssgd", {"bucket_mb": 64, "nonfinite": "off"}, Cluster(2, plain))
    est1 = estimate(prof, "ssgd", {"bucket_mb": 64, "nonfinite": "off"}, Cluster(2, tbf))
    bucket = 4 * numel + 4
    wire_bytes = wire.allreduce_bytes(bucket, 2)
    assert est0.step_s == pytest.approx(0.03 + plain.allreduce_s(bucket, 2))
    # one all-reduce per step, 30 ms of compute between them: 192 KB of refill, a full bucket each time
    assert est1.step_s == pytest.approx(0.03 + plain.allreduce_s(bucket, 2) - 96 * 1024 * 8 / 50e6)
    assert est1.bytes_sent == pytest.approx(est0.bytes_sent) == pytest.approx(wire_bytes)
    with pytest.raises(ValueError):
        Network(50e6, burst_bytes=-1)


@pytest.mark.parametrize("model_name", ["gpt-ngram", "resnet20"])
def test_measured_profile_records_the_lazy_updates_default_set(model_name, tmp_path):
    """A measured profile keeps the lazy set that the algorithm picks from the forward order,
    and the model uses it: a language model's embedding tables; ResNet-20's stage-2
    projection as the probe (registered after conv2, so the registration rule would miss it)."""
    from lowband.algorithms.lazy import ForwardOrder, LazyPlan, input_side_layers
    from lowband.app.models import make_model
    from lowband.perf.profile import measure_compute, example_batch
    c = measure_compute(model_name, batch_size=2, reps=1, warmup=0)
    prof = make_profile([p.numel for p in c["params"]], [0.0] * len(c["params"]))
    prof.params, prof.lazy_default = c["params"], c["lazy_default"]
    path = tmp_path / "p.json"
    prof.save(str(path))
    prof = load_profile(str(path))                             # survives the file
    lazy, probe = lazy_split(prof, None)
    model = make_model(model_name)
    recorder = ForwardOrder(input_side_layers(model))
    model(example_batch(model_name, model, 2)[0])
    params = [p for p in model.parameters() if p.requires_grad]
    plan = LazyPlan.build(model, params, recorder.order, None)
    assert lazy == plan.indices and probe == plan.slices[-1]
    names = [p.name for p in prof.params]
    if model_name == "gpt-ngram":
        assert [names[i] for i in lazy] == ["pos.weight", "ngrams.0.weight", "ngrams.1.weight"]
    else:
        assert [names[i] for i in probe] == ["layers.3.shortcut.0.weight"]
    recorded = prof.lazy_default
    prof.lazy_default = None                                   # a hand-written profile: registration order
    assert lazy_split(prof, None) != (lazy, probe)
    for bad in (dict(recorded, parameters=["nope"]), {"parameters": recorded["parameters"]}, ["pos.weight"]):
        prof.lazy_default = bad
        with pytest.raises(ProfileError, match="lazy_default"):
            prof.check()


def test_the_pipelines_cpu_beyond_the_codec_is_charged_once_per_compressed_bucket():
    """``pipeline_cpu_s`` (a pipeline thread's CPU per step at one rank) less the codec work the
    model charges at one rank rides with each compressed bucket's encode: with a free network
    and nothing to overlap (all gradients ready at the end), compressed's step grows by exactly
    that remainder; a measurement below the modelled codec adds nothing; a bucket of only 1-D
    parameters (fp32, no codec) gets none of it."""
    import dataclasses
    free = Cluster(2, Network(1e15, 0.0))
    numel = 1_000_000
    prof = make_profile([numel], [0.0], forward=0.004, optimizer=0.001, codec=_codec())
    cd = prof.codec("2bit")
    at_one = cd.encode_s(4 * numel) + cd.decode_s(4 * numel)
    opts = {"nonfinite": "off", "warmup_steps": 0}
    for kind in ("compressed", "cpsgd"):
        base = estimate(prof, kind, opts, free).step_s
        more = dataclasses.replace(prof, pipeline_cpu_s={kind: at_one + 0.003})
        assert estimate(more, kind, opts, free).step_s == pytest.approx(base + 0.003, rel=1e-6)
        less = dataclasses.replace(prof, pipeline_cpu_s={kind: 0.5 * at_one})
        assert estimate(less, kind, opts, free).step_s == pytest.approx(base, rel=1e-9)
    vectors = make_profile([1000], [0.0], forward=0.004, optimizer=0.001, codec=_codec())
    vectors.params[0] = dataclasses.replace(vectors.params[0], shape=[1000])
    base = estimate(vectors, "compressed", opts, free).step_s
    assert estimate(dataclasses.replace(vectors, pipeline_cpu_s={"compressed": 0.01}), "compressed", opts,
                    free).step_s == pytest.approx(base, rel=1e-9)
    with pytest.raises(Exception, match="pipeline_cpu_s"):
        dataclasses.replace(prof, pipeline_cpu_s={"cpsgd": -1.0}).check()


def _flag_width(rows: int, n: int) -> int:
    """sparse_rows' packed flags of ``rows`` table rows among n ranks, from its description:
    b bits per row with 2**b > n, (22 - b) // b rows per fp32 value."""
    b = next(b for b in range(1, 12) if 2 ** b > n)
    return math.ceil(rows / ((22 - b) // b))


def _with_table(prof, i, rows, **more):
    """``prof`` with parameter i an embedding table of ``rows`` rows (``table``)."""
    import dataclasses
    p = prof.params[i]
    prof.params[i] = dataclasses.replace(p, shape=[rows, p.numel // rows], table=True, **more)
    return prof


@pytest.mark.parametrize("n", [2, 4])
def test_cp_diloco_sends_the_packed_row_flags_of_its_untied_tables(n):
    """sparse_rows (the default): each round's message carries its embedding tables' trained-row
    flags, packed, as an exact fp32 segment. With codes that cost nothing, turning it on adds
    exactly what an fp32 all-reduce of the packed values sends per round (allgather at 2 ranks,
    two-stage at 4: both carry exact values at a ring all-reduce's bytes); gpt-ngram's 8320
    rows are 3328 B at 2 ranks and 5548 B at 4. A tied table (held by another module too: no
    ``table``) adds nothing, nor does sparse_rows on a model without tables."""
    import dataclasses
    rows, H = 8320, 4
    free_codes = CodecInfo(encode_gbps=1.0, decode_gbps=1.0, payload_ratio=0.0)
    prof = make_profile([rows * 16, 256 * 16, 5000, 1], [0.001] * 4, codec=free_codes)
    prof = _with_table(prof, 0, rows)
    prof.params[1] = dataclasses.replace(prof.params[1], shape=[256, 16], owners=["m1", "head"])   # tied
    cl = Cluster(n, Network(1 * GBIT, 1e-5))

    def per_round(p, **opts):
        return estimate(p, "cp-diloco", {"sync_every": H, **opts}, cl).bytes_sent * H

    width = _flag_width(rows, n)
    assert 4 * width == {2: 3328, 4: 5548}[n]
    assert per_round(prof) - per_round(prof, sparse_rows=False) == pytest.approx(wire.allreduce_bytes(4 * width, n))
    # with 2-bit codes the segment's (zero) codes travel as well
    coded = dataclasses.replace(prof, codecs={"2bit": _codec()})
    assert per_round(coded) - per_round(coded, sparse_rows=False) > wire.allreduce_bytes(4 * width, n)
    # no table: nothing changes
    plain = dataclasses.replace(prof, params=[dataclasses.replace(p, table=False) for p in prof.params])
    on, off = (estimate(plain, "cp-diloco", {"sync_every": H, "sparse_rows": s}, cl) for s in (True, False))
    assert (on.bytes_sent, on.step_s) == (off.bytes_sent, off.step_s)


@pytest.mark.parametrize("n", [2, 4])
def test_cp_diloco_lazy_layers_travel_in_a_message_of_their_own_every_tau_rounds(n):
    """lazy_layers: the selected parameters leave the round's message and travel in their own
    message (with their tables' flags and the three statistics of the auto rule) every tau-th
    round. All in fp32 (correction_every=1), each message is one ring all-reduce: with
    lazy_every=4 the lazy message's bytes count once per 4 rounds. Compressed, the bytes per
    round are E + L / tau (E the round's own message, L the lazy one)."""
    rows, dim, H = 1000, 8, 4
    prof = _with_table(make_profile([rows * dim, 3000, 1], [0.001] * 3, codec=_codec()), 0, rows)
    cl = Cluster(n, Network(1 * GBIT, 1e-5))

    def per_round(**opts):
        return estimate(prof, "cp-diloco", {"sync_every": H, **opts}, cl).bytes_sent * H

    eager, lazy = 4 * (3000 + 1), 4 * rows * dim + 4 * _flag_width(rows, n) + 4 * 3
    exact = {"correction_every": 1, "lazy_layers": "embeddings"}
    got = per_round(**exact, lazy_every=4)
    assert got == pytest.approx(wire.allreduce_bytes(eager, n) + wire.allreduce_bytes(lazy, n) / 4)
    assert per_round(correction_every=1) == pytest.approx(wire.allreduce_bytes(eager + lazy - 12, n))
    # the module's name selects the same parameters; "auto" takes the mean tau given (default 4)
    assert per_round(correction_every=1, lazy_layers="m0", lazy_every=4) == pytest.approx(got)
    assert per_round(**exact, lazy_every="auto") == pytest.approx(got)
    assert per_round(**exact, lazy_every="auto", tau=4) == pytest.approx(got)
    assert per_round(**exact, lazy_every="auto", tau=64, max_lazy_every=8) == pytest.approx(
        per_round(**exact, lazy_every=8))
    # compressed (spread correction): E + L / tau, a fractional mean tau included
    b1, b4 = (per_round(lazy_layers="embeddings", lazy_every=t) for t in (1, 4))
    L = (b1 - b4) * 4 / 3
    assert L > 0 and per_round(lazy_layers="embeddings", lazy_every=2) == pytest.approx(b1 - L / 2)
    assert per_round(lazy_layers="embeddings", tau=2.5) == pytest.approx(b1 - L + L / 2.5)
    for bad in ("m9", "m0,m1,m2"):       # no module of the profile; every parameter
        with pytest.raises(ValueError, match="lazy_layers"):
            per_round(lazy_layers=bad)


def test_cp_diloco_auto_round_is_no_longer_with_lazy_layers():
    """sync_every="auto" fits H to the round's message: with lazy_layers that is the round's
    own message plus the lazy one's over tau, so H shrinks with the lazy group and with tau."""
    from lowband.perf.model import resolved_options
    from lowband.perf.plan import check_algorithm
    rows = 4096
    prof = _with_table(make_profile([rows * 64, 200_000, 1000], [0.004, 0.004, 0.001], forward=0.01,
                                    codec=_codec()), 0, rows)
    for n in (2, 4):
        cl = Cluster(n, Network(20e6, 1e-4))

        def H(**opts):
            return resolved_options(prof, "cp-diloco", opts, cl)["sync_every"]

        whole, h4, h16 = H(), H(lazy_layers="embeddings", lazy_every=4), H(lazy_layers="embeddings", lazy_every=16)
        assert 4 < whole < 64 and h16 <= h4 < whole, (n, whole, h4, h16)
        assert H(lazy_layers="embeddings") == h4                # "auto": the model's mean tau, 4
        assert H(lazy_layers="embeddings", sparse_rows=False) <= h4
    check_algorithm("cp-diloco", {"lazy_layers": "embeddings", "tau": 8})   # tau: a model option


@pytest.mark.parametrize("model_name", ["gpt", "gpt-ngram"])
def test_the_profile_selects_tables_and_lazy_layers_as_cp_diloco_does(model_name, tmp_path):
    """A profile built from the model records each parameter's table flag (the algorithm's
    ``row_tables``) and a tied weight's holders, and the model's selection of ``lazy_layers``
    from it is the run's ``lazy_parameters`` (gpt's tied ``tok.weight`` is no table and lazy
    under no spec, since ``head`` holds it too). A profile without the fields loads with no
    tables."""
    from lowband.algorithms.cp_diloco import lazy_parameters
    from lowband.algorithms.sparse_rows import row_tables
    from lowband.app.models import make_model
    from lowband.perf.model import lazy_selection
    from lowband.perf.profile import param_infos
    model = make_model(model_name)
    params = [p for p in model.parameters() if p.requires_grad]
    prof = make_profile([1] * len(params), [0.0] * len(params))
    prof.params = param_infos(model)
    path = tmp_path / "p.json"
    prof.save(str(path))
    prof = load_profile(str(path))
    tables = [i for i, p in enumerate(prof.params) if p.table]
    assert tables == row_tables(model, params, list(range(len(params))))
    names = [p.name for p in prof.params]
    assert [names[i] for i in tables] == ["pos.weight"] + (["ngrams.0.weight", "ngrams.1.weight"]
                                                           if model_name == "gpt-ngram" else [])
    assert prof.params[names.index("tok.weight")].holders == ["tok", "head"]
    specs = ["embeddings", "tok", "head", "tok,pos", "tok+head", "blocks.0", "blocks", "ln_f+pos"]
    for spec in specs + (["ngrams", "ngrams.1+pos"] if model_name == "gpt-ngram" else []):
        assert lazy_selection(prof, spec) == lazy_parameters(model, params, spec), spec
    with pytest.raises(ValueError, match="no_such"):
        lazy_selection(prof, "no_such")
    old = prof.to_dict()
    for p in old["params"]:
        del p["table"], p["owners"]
    assert not any(p.table or p.owners for p in Profile.from_dict(old).params)
