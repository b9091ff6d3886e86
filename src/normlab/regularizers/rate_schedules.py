"""Schedules for a regularizer's rate p as a function of the training step (a named choice).

Steps count from 1 like the learning-rate schedule (lr_schedule.py: the paper's step = optimizer
steps done + 1), so with `warmup` equal to the LR warmup the V's bottom (p = 0) falls on the same
step as the LR peak, as Zhou et al. 2020 do.

v_shape (Scheduled DropHead, Zhou et al. 2020):
    step ≤ warmup:          p = p_start · (1 − step / warmup)          (p_start → 0)
    warmup < step ≤ total:  p = p_end · (step − warmup) / (total − warmup)  (0 → p_end)
with p_start = p_end by default; beyond `total` p stays p_end. warmup = 0 skips the falling leg.
"""
from __future__ import annotations

SCHEDULES = ("constant", "v_shape")
DEFAULT_SCHEDULE = "v_shape"  # Zhou et al. 2020's: callbacks.drophead_schedule and its config check


def constant(step: int, p: float, **_) -> float:
    return float(p)


def v_shape(step: int, p: float, total: int, warmup: int, p_start: float | None = None) -> float:
    p_start = p if p_start is None else p_start
    if step <= warmup:
        return p_start * (1.0 - step / warmup) if warmup > 0 else 0.0
    if total <= warmup:
        return float(p)
    return p * min(step - warmup, total - warmup) / (total - warmup)


def schedule_value(name: str, step: int, p: float, total: int | None = None, warmup: int = 0,
                   p_start: float | None = None) -> float:
    if name == "constant":
        return constant(step, p)
    if name == "v_shape":
        if total is None or total <= 0:
            raise ValueError("the v_shape DropHead schedule needs the last step (trainer.max_steps > 0)")
        return v_shape(step, p, total, warmup, p_start)
    raise ValueError(f"schedule {name!r} is not valid; allowed values: {', '.join(SCHEDULES)}")
