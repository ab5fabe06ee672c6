"""The finiteness test of one gradient, shared by the engine's guard and the compressed collectives'
non-finite flag bit."""
from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor: no NaN/Inf in ``t``. On CPU a finite sum proves it in one pass with
    no temporary (a NaN or Inf always makes the sum NaN or Inf); only a non-finite sum, which
    may also be an overflow of finite values, pays for the exact element-wise test. On an
    accelerator the exact test is cheap and avoids a host sync per parameter."""
    if t.device.type == "cpu":
        ok = torch.isfinite(t.sum())
        return ok if bool(ok) else torch.isfinite(t).all()
    return torch.isfinite(t).all()
