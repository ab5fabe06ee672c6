"""The performance model's validation probes (benchmarks/validate_perfmodel.py): the hook chain
really chains all-reduces through future callbacks, and the step probe's costs are the medians
the docstring describes."""
from __future__ import annotations

import os
import sys

import pytest

from .distributed import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import validate_perfmodel as validate  # noqa: E402


def _chain(rank: int, world: int):
    import sys
    import torch
    links = [torch.full((validate.CHAIN_FLOATS,), float(rank + 1 + 10 * k)) for k in range(validate.CHAIN_LINKS)]
    launched_by = []
    real_all_reduce = torch.distributed.all_reduce

    def spy(*args, **kwargs):
        launched_by.append(sys._getframe(1).f_code.co_name)    # the function that launched it
        return real_all_reduce(*args, **kwargs)
    torch.distributed.all_reduce = spy
    try:
        spans = validate.chain(links)
    finally:
        torch.distributed.all_reduce = real_all_reduce
    return spans, [float(t[0]) for t in links], launched_by


def test_the_hook_chain_launches_each_link_from_the_previous_ones_callback():
    world = 2
    for spans, sums, launched_by in run_distributed(_chain, world):
        assert len(spans) == validate.CHAIN_LINKS - 1 and all(s > 0 for s in spans)
        # every link is a real all-reduce of every rank's tensor
        assert sums == [sum(r + 1 + 10 * k for r in range(world)) for k in range(validate.CHAIN_LINKS)]
        # the first by the caller, each other one inside the previous one's future callback (on
        # gloo's thread, or on the caller's when that future had completed before .then(): a
        # thread test flaked on exactly that race)
        assert launched_by == ["chain"] + ["callback"] * (validate.CHAIN_LINKS - 1)


def test_step_probe_costs_are_medians_of_rank_means_of_step_medians():
    # 2 ranks, 3 rounds of 3 steps; chained: 2 links per step
    ranks = [{"first": [[1, 2, 9], [4, 4, 4], [1, 1, 1]], "second": [[0, 0, 0]] * 3,
              "chained": [[[1, 5], [2, 6], [3, 7]]] * 3},
             {"first": [[3, 3, 3], [2, 6, 6], [9, 9, 1]], "second": [[1, 1, 1]] * 3,
              "chained": [[[3, 1], [3, 1], [3, 1]]] * 3}]
    costs = validate.step_probe_costs(ranks)
    # first: rounds' rank means (2+3)/2, (4+6)/2, (1+9)/2 = 2.5, 5, 5 -> median 5
    assert costs["step_sync_s"] == pytest.approx(5.0)
    assert costs["met_again_s"] == pytest.approx(0.5)
    assert costs["chained_s"] == pytest.approx([(2 + 3) / 2, (6 + 1) / 2])
    # runs from before the chain: no chained costs
    assert "chained_s" not in validate.step_probe_costs([{k: r[k] for k in ("first", "second")} for r in ranks])


def test_latency_is_the_median_probe_run_over_the_rings_messages():
    # five runs, two in the probe's high mode: the median run decides, over 2(N-1) messages
    medians = [3.1e-3, 0.42e-3, 1.3e-3, 0.39e-3, 0.45e-3]
    assert validate.latency_from_probes(medians, 2) == pytest.approx(0.45e-3 / 2)
    assert validate.latency_from_probes(medians, 4) == pytest.approx(0.45e-3 / 6)
    with pytest.raises(ValueError):
        validate.latency_from_probes([], 2)


def test_the_step_probe_latency_is_its_warm_all_reduce_over_the_rings_messages():
    assert validate.latency_from_step_probe(0.24e-3, 2) == pytest.approx(0.12e-3)
    assert validate.latency_from_step_probe(0.72e-3, 4) == pytest.approx(0.12e-3)
    with pytest.raises(ValueError):
        validate.latency_from_step_probe(1e-3, 1)


def _step_probe_run(first: float, second: float, links: tuple) -> dict:
    rank = {"first": [[first] * 3], "second": [[second] * 3], "chained": [[list(links)] * 3]}
    return {"ranks": [rank, rank]}


def test_the_step_probes_costs_are_the_median_of_its_runs_each_cost_apart():
    runs = [_step_probe_run(1e-3, 2e-4, (0.7e-3, 2.0e-3)), _step_probe_run(3e-3, 1e-4, (1.9e-3, 0.7e-3)),
            _step_probe_run(2e-3, 3e-4, (1.3e-3, 1.2e-3))]
    costs = validate.probed_costs({"step_syncs": runs})
    assert costs["step_sync_s"] == pytest.approx(2e-3) and costs["met_again_s"] == pytest.approx(2e-4)
    assert costs["chained_s"] == pytest.approx([1.3e-3, 1.2e-3])
    # a run of before the rule: its one probe as it is; before the step probe: nothing
    one = validate.probed_costs({"step_sync": runs[1]})
    assert one["step_sync_s"] == pytest.approx(3e-3) and one["chained_s"] == pytest.approx([1.9e-3, 0.7e-3])
    assert validate.probed_costs({}) == {}
