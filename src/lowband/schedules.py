"""Learning-rate schedules as plain functions of the step: a factor that multiplies the
configured learning rate (``torch.optim.lr_scheduler.LambdaLR`` applies it)."""
from __future__ import annotations

import math

#: where ``warmup-cosine`` ends, as a share of the peak rate (the usual LM recipe decays to 10%)
COSINE_FINAL_RATIO = 0.1


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, final_ratio: float = COSINE_FINAL_RATIO) -> float:
    """Linear warm-up over ``warmup_steps`` (step 0 trains at 1/warmup of the peak), then a
    cosine decay from the peak to ``final_ratio`` of it at ``total_steps``; flat after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
