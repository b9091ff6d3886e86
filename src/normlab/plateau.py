"""When a run has stopped learning: its validation loss improved by less than `min_delta` over the
last `window` optimizer steps (issue 35: train to a plateau, and say where each arm ended).

At a validation step s with a validation at or before s − window:
    improvement(s) = min(valid loss at steps <= s − window) − min(valid loss at steps <= s)
    plateau at s  <=>  improvement(s) < min_delta
The best-so-far losses make the rule blind to a noisy last validation (one bad value does not end
a run that is still improving) and a loss that rises again counts as no improvement. Pure: the
callback (callbacks/plateau.py) decides with it while training, and the study judges older records
with it from their metrics.csv, so both read a curve the same way.
"""
from __future__ import annotations

import math
from typing import Sequence


def plateau_step(steps: Sequence[int], losses: Sequence[float], window: int, min_delta: float) -> int | None:
    """The first validation step at which the curve is on a plateau, else None (still improving, or
    not yet `window` steps of validations). `steps` ascending; a non-finite loss is no improvement."""
    if window < 1 or min_delta < 0:
        raise ValueError(f"window={window} must be >= 1 and min_delta={min_delta} >= 0")
    best: list[float] = []  # best-so-far at each validation
    for loss in losses:
        value = float(loss) if math.isfinite(float(loss)) else math.inf
        best.append(min(value, best[-1]) if best else value)
    j = -1  # the last validation at or before steps[i] - window
    for i, s in enumerate(steps):
        while j + 1 < i and steps[j + 1] <= s - window:
            j += 1
        if j >= 0 and steps[j] <= s - window:
            before, now = best[j], best[i]
            if not (before - now >= min_delta):  # inf - inf (nothing finite yet) is no improvement
                return int(s)
    return None
