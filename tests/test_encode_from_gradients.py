"""``compressed`` on the CPU with native kernels: past the warm-up, the gradients of coded
parameters are not copied into the bucket; the native encoder reads each one where autograd
left it (``BucketSet.by_reference``, the reducer's ``sources``). The trajectory must be the one
of copied gradients (the path taken where the encoder cannot read them there: a reducer whose
``reads_sources`` is False), bit for bit, whatever the bucket layout, the codec, the collective
and how the loop zeroes gradients; a NaN in such a gradient is still caught and named; and the
path must really be taken (counted)."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch import nn

import lowband
from lowband import _native as kernels
from lowband.comm.reducer import CompressedReducer

from .distributed import run_distributed
from .training import (ZEROING, PartlyUsed, SmallNet, assert_same_params_and_grads, batches, make_optimizer,
                       poisoned_steps, zeroing_steps)


class WithUnused(SmallNet):
    """SmallNet with a layer no rank ever uses."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(3, 3)


class Transposed(SmallNet):
    """SmallNet whose last weight is stored column-major, so autograd makes its gradient so too
    (torch's layout contract): not contiguous, so it is copied into the bucket while the other
    coded gradients are read where they are."""

    def __init__(self):
        super().__init__()
        self.fc2.weight.data = self.fc2.weight.data.t().contiguous().t()


STEPS = 12                       # well past the warm-up of 3
WARMUP = 3
#: (model, knobs): bucket layouts, codecs and collectives
CASES = {
    "one bucket": (SmallNet, {}),
    "several buckets": (SmallNet, {"bucket_mb": 0.01}),
    "partly used": (PartlyUsed, {}),
    "unused layer": (WithUnused, {}),
    "transposed": (Transposed, {}),
    "vectors coded": (SmallNet, {"compress_vectors": True}),
    "1bit two-stage": (SmallNet, {"compressor": "1bit", "collective": "two-stage", "bucket_mb": 0.01}),
    "mxnet 2bit": (SmallNet, {"compressor": "2bit", "compressor_options": {"threshold": 0.01}}),
}


def _train(rank: int, world: int, net, options: dict, zeroing: str, by_reference: bool):
    torch.manual_seed(0)
    model = net(rank) if net is PartlyUsed else net()
    opt = make_optimizer("sgd", model)
    # the copied path: a reducer that cannot read sources (the algorithm asks once, when bound)
    copied = mock.patch.object(CompressedReducer, "reads_sources", return_value=False)
    with contextlib.nullcontext() if by_reference else copied:
        engine = lowband.distribute(model, opt, "compressed", warmup_steps=WARMUP, **options)
    reducer = engine.bound.reducer
    start, read = reducer.start, []

    def counting_start(*args, sources=None, **kw):
        read.append(0 if sources is None else sum(s is not None for s in sources))
        return start(*args, sources=sources, **kw)

    reducer.start = counting_start
    per_step = []

    def count():
        per_step.append(sum(read))
        read.clear()

    params, grads = zeroing_steps(engine, model, opt, batches(rank, world).epoch(0), STEPS, zeroing, count)
    engine.close()
    return params, grads, per_step


def _all(rank: int, world: int):
    out = {}
    for case, (net, options) in CASES.items():
        for zeroing in ZEROING:
            for by_reference in (True, False):
                out[case, zeroing, by_reference] = _train(rank, world, net, options, zeroing, by_reference)
    return out


@pytest.fixture(scope="module")
def runs():
    if kernels.library_having("has_sources") is None:
        pytest.fail(f"native kernels without the *_encode_at entry points: {kernels.unavailable_reason()}")
    return run_distributed(_all, 2)


@pytest.mark.parametrize("zeroing", ZEROING)
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_encoded_where_they_are_train_to_the_same_bits_as_copies(runs, case, zeroing):
    for rank, out in enumerate(runs):
        params, grads, read = out[case, zeroing, True]
        ref_params, ref_grads, ref_read = out[case, zeroing, False]
        assert_same_params_and_grads((params, grads), (ref_params, ref_grads), rank)
        # read where they are in every compressed step (not in the warm-up, never when off);
        # their average is written back there, so they never become views of the bucket
        assert read[:WARMUP] == [0] * WARMUP and ref_read == [0] * STEPS, (read, ref_read)
        assert all(r > 0 for r in read[WARMUP:]), read


def test_only_the_contiguous_coded_gradients_are_read_where_they_are(runs):
    """SmallNet has two coded matrices and a conv kernel, and 1-D biases that travel exact (copied)."""
    read = runs[0]["one bucket", "none", True][2]
    assert read[WARMUP:] == [3] * (STEPS - WARMUP)
    read = runs[0]["transposed", "none", True][2]
    assert read[WARMUP:] == [2] * (STEPS - WARMUP)
    read = runs[0]["vectors coded", "none", True][2]
    assert read[WARMUP:] == [6] * (STEPS - WARMUP)


BAD_STEP = 6


def _nan_run(rank: int, world: int, collective: str):
    """Rank 1's loss gets a NaN through the first linear layer's weight (a coded matrix, read
    where it is) at BAD_STEP, past the warm-up of 2; the engine's policy "raise" must name it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = lowband.distribute(model, opt, lowband.CompressedSGD(warmup_steps=2, collective=collective),
                                nonfinite="raise")
    by_reference = []        # for the next step, after each step
    try:
        poisoned_steps(engine, opt, batches(rank, world).epoch(0), BAD_STEP, BAD_STEP if rank == 1 else 0,
                       lambda: float("nan") * model[1].weight.sum(),
                       lambda: by_reference.append(engine.bound.buckets.by_reference))
    except lowband.NonFiniteGradientError as e:
        return e.step, e.bad, by_reference
    finally:
        engine.close()
    return None


@pytest.mark.parametrize("collective", ["allgather", "two-stage"])
def test_a_nan_in_a_gradient_read_where_it_is_is_caught_and_named(collective):
    for result in run_distributed(_nan_run, 2, collective):
        assert result == (BAD_STEP, {1: "1.weight"}, [False, True, True, True, True]), result
