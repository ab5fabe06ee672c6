"""Gradient buckets (lowband.algorithms.buckets) against the obvious flat concatenation."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lowband.algorithms.buckets import BucketSet


def _params(dtype: torch.dtype) -> list[nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(3, 2, 5, 5), (3,), (4, 7), (7,), (2, 3, 1, 1)]
    return [nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def _set_grads(params, step: int) -> None:
    for i, p in enumerate(params):
        g = (torch.full(p.shape, float(100 * step + i)) + torch.arange(p.numel()).view(p.shape) / 1000).to(p.dtype)
        if p.dim() == 4:   # a channels-last gradient: strides unlike the bucket's
            g = g.contiguous(memory_format=torch.channels_last)
        p.grad = g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])   # bfloat16: no numpy flags
def test_double_buffered_buckets_hold_each_steps_gradients_in_place(dtype):
    params = _params(dtype)
    launched = []
    # the raw buffer, not the bucket's cached views: what a job handed the buffer reads
    buckets = BucketSet(params, range(len(params)), 200, lambda b: launched.append(
        (b.index, b.buffer[:b.numel].clone(), b.buffer[b.numel:].clone(), b.buffer.data_ptr(), b.complete,
         b.present())),
        double_buffered=True)
    assert len(buckets.buckets) > 1
    kept = {}
    for step in range(3):
        _set_grads(params, step)
        missing = 3 if step == 2 else None       # parameter 3 gets no gradient in the last step
        for i in reversed(range(len(params))):
            if i != missing:
                buckets.mark_ready(i)
        buckets.launch_remaining()
        for b in buckets.buckets:
            expect = torch.cat([torch.zeros(params[i].numel(), dtype=dtype) if i == missing
                                else params[i].grad.reshape(-1) for i in b.param_indices])
            flags = torch.tensor([0.0 if i == missing else 1.0 for i in b.param_indices], dtype=dtype)
            assert torch.equal(b.buffer[:b.numel], expect) and torch.equal(b.buffer[b.numel:], flags)
            assert torch.equal(b.grads, expect) and torch.equal(b.flags, flags)
            assert (b.views().host_flags is None) == (dtype == torch.bfloat16)
            assert b.complete == (missing not in b.param_indices)
            kept[(step, b.index)] = (b.buffer.data_ptr(), expect)
        buckets.reset()
    # each step's launches saw exactly that step's values, in bucket order, alternating buffers
    assert [x[0] for x in launched] == list(range(len(buckets.buckets))) * 3
    for n, (index, grads, flags, ptr, complete, present) in enumerate(launched):
        step = n // len(buckets.buckets)
        assert ptr == kept[(step, index)][0] and torch.equal(grads, kept[(step, index)][1])
        assert flags.sum() == len(buckets.buckets[index].param_indices) - (not complete)
        # a reducer's present=: None ("every one") for a complete bucket, else the flags
        assert (present is None) == complete and (complete or torch.equal(present, flags > 0))
        if step:
            assert ptr != kept[(step - 1, index)][0]
    assert not all(x[4] for x in launched)      # the missing parameter's bucket was incomplete
    # reset leaves the last step's buffer (the spare now, which a pipeline may still be
    # reading) as it was, and the next step fills the other one
    for b in buckets.buckets:
        ptr, values = kept[(2, b.index)]
        assert b.spare.data_ptr() == ptr and torch.equal(b.spare[:b.numel], values)
        assert b.buffer.data_ptr() == kept[(1, b.index)][0] and not b.buffer[b.numel:].any()
