"""2-bit scale-aware mode (``relative=a``): threshold a*rms, fired elements decode to the mean
magnitude of the fired set, one fp32 scale on the wire; MXNet mode stays as it was."""
from __future__ import annotations

import math

import pytest
import torch

from lowband.codecs import DEFAULT_TWO_BIT_OPTIONS, build_compressor
from lowband.codecs import ErrorFeedback, TwoBitQuantizer, make_compressor


def _reference(r: torch.Tensor, a: float, block: int | None) -> tuple[torch.Tensor, list[float]]:
    """Plain-torch, block-by-block statement of the rule: (decoded q, value v per block)."""
    out, values = [], []
    for part in r.split(block or max(1, r.numel())):
        t = a * part.pow(2).mean().sqrt()
        fired = part.abs() >= t
        v = part.abs()[fired].mean() if fired.any() else t
        out.append(torch.where(fired, torch.sign(part) * v, torch.zeros_like(part)))
        values.append(float(v))
    return torch.cat(out), values


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000])
@pytest.mark.parametrize("a", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("block", [None, 16, 100])
def test_relative_matches_reference_rule(n, a, block):
    r = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3e-3
    r[: n // 2] *= 30   # two "layers" with very different scales
    q = TwoBitQuantizer(relative=a, scale_block=block)
    payload, ctx = q.compress(r, "g")
    expected, values = _reference(r, a, block)
    assert payload[1].dtype == torch.float32
    torch.testing.assert_close(payload[1], torch.tensor(values), rtol=1e-5, atol=0)
    torch.testing.assert_close(q.decompress(payload, ctx), expected, rtol=1e-5, atol=0)
    scales = math.ceil(n / (block or n))
    assert sum(p.numel() * p.element_size() for p in payload) == q.payload_nbytes(n) == 4 * math.ceil(n / 16) + 4 * scales


@pytest.mark.parametrize("block", [None, 64])
def test_relative_error_feedback_conserves_mass_and_matches_generic_path(block):
    ef = ErrorFeedback(TwoBitQuantizer(relative=1.0, scale_block=block))
    gen = torch.Generator().manual_seed(0)
    sent, total = torch.zeros(301), torch.zeros(301)
    for _ in range(20):
        g = torch.randn(301, generator=gen) * 1e-3
        before = ef.residual("g").clone() if total.any() else torch.zeros(301)
        payload, ctx = ef.compress(g, "g")
        decoded = ef.decompress(payload, ctx)
        # the fused residual update equals the generic r - decompress(compress(r))
        torch.testing.assert_close(ef.residual("g"), before + g - decoded, rtol=0, atol=1e-9)
        sent += decoded
        total += g
    torch.testing.assert_close(sent + ef.residual("g"), total, rtol=0, atol=1e-6)


def test_zero_tensor_encodes_to_zero():
    q = TwoBitQuantizer(relative=1.0)
    payload, ctx = q.compress(torch.zeros(40), "z")
    assert torch.equal(q.decompress(payload, ctx), torch.zeros(40))


def test_exactly_one_of_threshold_or_relative():
    for bad in ({}, {"threshold": 0.1, "relative": 1.0}, {"relative": 0.0}, {"relative": -1.0},
                {"threshold": 0.1, "scale_block": 64}, {"relative": 1.0, "scale_block": 0}):
        with pytest.raises(ValueError):
            make_compressor("2bit", **bad)
    assert make_compressor("2bit", threshold=0.1).payload_nbytes(32) == 8   # MXNet: codes only


def test_algorithm_default_and_explicit_mxnet_mode():
    default = build_compressor("2bit", {})
    assert repr(default) == repr(TwoBitQuantizer(**DEFAULT_TWO_BIT_OPTIONS))
    exact = build_compressor("2bit", {"threshold": 0.05})
    assert exact.relative is None and exact.threshold == pytest.approx(0.05)
