"""Pace: where each arm's training ended, read on the best arm's curve.

A study at a fixed step budget compares arms that learn at different speeds; a regulariser
(LayerDrop, DropHead) or a conservative scheme can lose at 2,000 steps and win at convergence. What
can be measured here is how far behind an arm is: the step at which the best arm (the best final
validation loss) first reached the loss the arm ended with. "ended where the best arm was at step
900 of 2,000" says "undertrained at this budget". The curve is the mean over the reference arm's
completed seeds, interpolated linearly between its validations (every `trainer.val_check_interval`
steps, so the step is approximate).
"""
from __future__ import annotations

import numpy as np

from normlab.study.records import Record
from normlab.study.spec import Study, lower_is_better


def _mean_curve(recs: list[Record], series: str) -> list[tuple[int, float]]:
    """The seeds' mean at the steps every seed validated at."""
    curves = [dict(r.curve(series)) for r in recs]
    curves = [c for c in curves if c]
    if not curves:
        return []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return [(s, float(np.mean([c[s] for c in curves]))) for s in steps]


def reached_at(curve: list[tuple[int, float]], target: float, lower: bool = True) -> float | None:
    """The first step at which `curve` reaches `target` (linear between points); None if it never does."""
    better = (lambda v: v <= target) if lower else (lambda v: v >= target)
    prev = None
    for step, v in curve:
        if better(v):
            if prev is None or prev[1] == v:
                return float(step)
            (s0, v0) = prev
            return s0 + (step - s0) * (v0 - target) / (v0 - v)
        prev = (step, v)
    return None


def pace_lines(study: Study, by_arm: dict[str, list[Record]]) -> list[str]:
    """The README section: one row per arm, or nothing when fewer than two arms have curves."""
    series, lower = study.curves, lower_is_better(study.curves)
    done = {a: [r for r in by_arm.get(a, []) if r.status == "completed"] for a in study.arms}
    curves = {a: _mean_curve(recs, series) for a, recs in done.items() if recs}
    curves = {a: c for a, c in curves.items() if c}
    if len(curves) < 2:
        return []
    final = {a: c[-1][1] for a, c in curves.items()}
    ref = (min if lower else max)(final, key=final.get)
    ref_label, ref_end = study.arms[ref].label, curves[ref][-1][0]
    lines = ["## Pace (where each arm ended, on the best arm's curve)", "",
             f"Each arm's {series} at its last validation (mean over completed seeds), and the step at which "
             f"{ref_label} (the best final {series}) first reached it, linear between its validations. An arm "
             "that ends where the best one was early in its budget is undertrained at this budget: the paper's "
             "comparison, at convergence, may still differ.", "",
             f"| arm | last step | {series} | {ref_label} reached it at step |", "|---|---|---|---|"]
    for arm, c in curves.items():
        at = reached_at(curves[ref], final[arm], lower)
        if arm == ref:
            cell = "(the reference)"
        elif at is None:
            cell = "not reached"
        else:  # steps are 0-based in metrics.csv: the validation after step 500 is at 499
            cell = f"~{at + 1:.0f} ({100 * (at + 1) / (ref_end + 1):.0f}% of its {ref_end + 1} steps)"
        lines.append(f"| {study.arms[arm].label} | {c[-1][0] + 1} | {final[arm]:.3f} | {cell} |")
    return lines + [""]
