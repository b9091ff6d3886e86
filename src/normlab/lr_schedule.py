"""Inverse-square-root learning rate with linear warmup (Vaswani et al. 2017, 5.3).

Paper: lr(step) = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), times an optional scale.
That is peak * min(step / warmup, sqrt(warmup / step)) with
peak = scale * d_model^-0.5 * warmup^-0.5 reached at step == warmup, which is how fairseq's
``inverse_sqrt`` states it; we accept either the peak (``optim.lr``) or the paper's scale.
"""
from __future__ import annotations

import math

SCHEDULES = ("inverse_sqrt", "constant", "inverse_sqrt_hold", "cosine", "linear")
DECAYING = ("cosine", "linear")  # to zero at the run's last step: they read trainer.max_steps


def peak_lr(d_model: int, warmup: int, lr: float | None, scale: float = 1.0) -> float:
    if lr is not None:
        return float(lr)
    return scale * d_model ** -0.5 * max(warmup, 1) ** -0.5


def inverse_sqrt_factor(step: int, warmup: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (1-based, as in the paper)."""
    step = max(step, 1)
    if warmup <= 0:  # no warmup (Nguyen & Salazar 2019 train ScaleNorm+FixNorm this way)
        return 1.0 / math.sqrt(step)
    return min(step / warmup, math.sqrt(warmup / step))


def constant_factor(step: int, warmup: int) -> float:
    """Linear warmup, then the peak lr held constant (Nguyen & Salazar 2019 train ScaleNorm+FixNorm
    at a constant 3e-4 with no warmup; their decay on dev-BLEU plateaus is not implemented)."""
    return min(max(step, 1) / warmup, 1.0) if warmup > 0 else 1.0


def inverse_sqrt_hold_factor(step: int, warmup: int) -> float:
    """No ramp: the peak lr from step 1, held for `warmup` steps, then inverse_sqrt's decay √(warmup/step).
    For a scheme its paper trains without warmup (nGPT, Loshchilov et al. 2025) beside arms on
    inverse_sqrt with the same `warmup`: from step `warmup` on, both are at the same multiple of their peak
    (inverse_sqrt with warmup 0 decays as 1/√step from step 1: 14x lower at step 200 than a 200-step
    warmup's peak)."""
    step = max(step, 1)
    return min(1.0, math.sqrt(warmup / step)) if warmup > 0 else 1.0 / math.sqrt(step)


def decay_factor(schedule: str, step: int, warmup: int, total: int) -> float:
    """Linear warmup, then a decay from the peak towards 0, reached one step after `total` (the run's trainer.max_steps):
    `cosine` as Loshchilov & Hutter 2017 (SGDR) without restarts, fairseq's `cosine` with min_lr 0;
    `linear` as fairseq's `polynomial_decay` with power 1 and end_learning_rate 0. For a run of a known,
    short budget (experiment=quick) a decay to zero reaches a lower loss than inverse_sqrt at the same
    step (Bergsma et al. 2025, "Straight to Zero: Why Linearly Decaying the Learning Rate to Zero Works
    Best for LLMs")."""
    step = max(step, 1)
    if warmup > 0 and step <= warmup:
        return step / warmup
    # as fairseq, from the updates already done after the warmup: the first update after it is at the
    # peak and the last (step == total) still above 0, which only a step past the run would reach
    done = min((step - 1 - warmup) / max(total - warmup, 1), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * done)) if schedule == "cosine" else 1.0 - done


def lr_factor(schedule: str, step: int, warmup: int, total: int | None = None) -> float:
    """`total`: the run's last step, read by the decaying schedules alone."""
    if schedule in DECAYING:
        if total is None:
            raise ValueError(f"optim.schedule={schedule} decays to 0 at the run's last step: give `total`")
        return decay_factor(schedule, step, warmup, total)
    if schedule == "constant":
        return constant_factor(step, warmup)
    if schedule == "inverse_sqrt_hold":
        return inverse_sqrt_hold_factor(step, warmup)
    return inverse_sqrt_factor(step, warmup)


def schedule_change_note(was: tuple, now: tuple, scheduler: dict) -> str | None:
    """resume= of a checkpoint whose schedule was `was` under the run's `now`, each (optim.schedule,
    optim.warmup, trainer.max_steps; None where a checkpoint from before it was recorded names none):
    what changed and the learning rate of the next update, as the checkpoint's scheduler set it
    (LambdaLR's `_last_lr`) and as the run's schedule has it (lit_module.on_train_start applies it from
    that update on, as fairseq's step_update on load); None when nothing changed and the lr is the same.
    Extending a run is legitimate (fairseq and Lightning let it be done), but a reader of the curves
    should be told of a jump, and of a curve that bends later. The total counts only for a decaying
    schedule (inverse_sqrt has none). The peak is the checkpoint's (base_lrs: resume restores it)."""
    names = ("optim.schedule", "optim.warmup", "trainer.max_steps")
    decays = was[0] in DECAYING or now[0] in DECAYING
    changed = [f"{n} {a} -> {b}" for n, a, b in zip(names, was, now)
               if a is not None and a != b and (n != "trainer.max_steps" or decays)]
    update, before = scheduler["last_epoch"] + 1, scheduler["_last_lr"][0]
    after = scheduler["base_lrs"][0] * lr_factor(now[0], update, now[1], now[2])
    jumps = not math.isclose(before, after, rel_tol=1e-9, abs_tol=1e-15)
    if not changed and not jumps:
        return None
    what = ", ".join(changed) or "the schedule (the checkpoint names none of its settings that differ)"
    if jumps:
        return f"{what}: the learning rate of update {update} jumps from {before:.4g} to {after:.4g}"
    return f"{what}: the learning rate of update {update} stays {after:.4g}; the updates after it follow the new one"
