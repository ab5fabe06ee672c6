"""``ssgd``'s ``gradient_as_bucket_view`` (DDP's knob, off by default): the average comes back in
the bucket and the gradients become views of it (``BucketSet.write_gradients(as_views=True)``):
the same trajectory, bit for
bit, as with the knob off (a new output, copied gradients), whether the loop zeroes gradients
to None, zeroes them in place or never zeroes them (then each backward accumulates into the
views, as it would into separate tensors); a parameter that no rank produced a gradient for
keeps ``grad = None``."""
from __future__ import annotations

import pytest
import torch

import lowband

from .distributed import run_distributed
from .training import ZEROING, PartlyUsed, SmallNet, assert_same_params_and_grads, batches, make_optimizer, zeroing_steps


class WithUnused(SmallNet):
    """SmallNet with a layer no rank ever uses."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(3, 3)


STEPS = 12
ALGORITHMS = ("ssgd",)
LAYOUTS = {"one": (SmallNet, {}), "several": (SmallNet, {"bucket_mb": 0.01}), "partly used": (PartlyUsed, {}),
           "unused": (WithUnused, {})}


def _train(rank: int, world: int, algorithm: str, net, options: dict, zeroing: str, views: bool):
    torch.manual_seed(0)
    model = net(rank) if net is PartlyUsed else net()
    opt = make_optimizer("sgd", model)
    options = {**options, "gradient_as_bucket_view": views}
    engine = lowband.distribute(model, opt, algorithm, **options)
    aliased = []

    def record_aliasing():
        buffers = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.numel() * 4)
                   for b in engine.bound.buckets.buckets]
        aliased.append([p.grad is not None and any(lo <= p.grad.data_ptr() < hi for lo, hi in buffers)
                        for p in model.parameters()])

    params, grads = zeroing_steps(engine, model, opt, batches(rank, world).epoch(0), STEPS, zeroing, record_aliasing)
    engine.close()
    return params, grads, aliased


def _both_ways(rank: int, world: int):
    out = {}
    for algorithm in ALGORITHMS:
        for layout, (net, options) in LAYOUTS.items():
            for zeroing in ZEROING:
                for views in (True, False):
                    out[algorithm, layout, zeroing, views] = _train(rank, world, algorithm, net, options, zeroing,
                                                                    views)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_both_ways, 2)


@pytest.mark.parametrize("zeroing", ZEROING)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gradients_as_bucket_views_train_to_the_same_bits_as_copies(runs, algorithm, layout, zeroing):
    for rank, out in enumerate(runs):
        params, grads, aliased = out[algorithm, layout, zeroing, True]
        ref_params, ref_grads, ref_aliased = out[algorithm, layout, zeroing, False]
        assert_same_params_and_grads((params, grads), (ref_params, ref_grads), rank)
        assert not any(any(a) for a in ref_aliased)
        assert all(a == [g is not None for g in grads.values()] for a in aliased[-1:]), aliased[-1]
        assert any(aliased[-1])


@pytest.mark.parametrize("zeroing", ZEROING)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_layer_no_rank_uses_keeps_no_gradient(runs, algorithm, zeroing):
    for out in runs:
        _, grads, _ = out[algorithm, "unused", zeroing, True]
        assert grads["unused.weight"] is None and grads["unused.bias"] is None
