"""Steps to a loss: the `fewer_steps` claim (A reaches B's final validation loss in fewer steps).

Loshchilov et al. 2025 (nGPT, arXiv 2410.01131), abstract: "reducing the number of training steps
required to achieve the same accuracy by a factor of 4 to 20". Judged here per paired seed s (a seed
both arms ran to completion, as every comparison pairs them: claims.py), on the claim's `metric`, a
validation curve of metrics.csv (valid_loss by default; lower is better):

- target(s): B's value at its last validation, where B stopped (its plateau, or its cap: a B still
  improving at its cap sets the target where it stopped, the loss at B's budget, and the speed-up is to
  that loss, not to a converged one; not budget-bound, and the note names such seeds).
- steps_X(s): the steps arm X trained until its curve first reached the target (<= it), linear
  between the validation before and the first one at or below it (metrics.csv steps are 0-based: a
  validation at step 499 is after 500 steps). The same rule for both arms: B's steps are those it took
  to first reach its own final value, so the flat tail of a plateau is not counted as B's.
- speed-up(s) = steps_B(s) / steps_A(s).
- A at or below the target at its first validation: there is no earlier point to interpolate from,
  so steps_A is an upper bound and the speed-up a lower bound (`first`).
- A never at or below the target by its last validation, after L_A steps: its speed-up is below
  steps_B / L_A. When that bound is <= margin, the seed contradicts the claim whatever A would do after
  (`never`: in a study with one cap for every arm, an A that ran to the cap without B's loss is here).
  When the bound is above the margin (A stopped early) and A was still improving when it stopped
  (Record.still_improving, by the study's `plateau:`), more steps could still meet the margin: the
  seed is `budget-bound`; otherwise (A stopped at a plateau above the target) it contradicts (`never`).

The verdict, on the log speed-ups over the seeds with the seed-level t interval (stats.seed_interval
with the paired values' own variance, df n − 1: the pairing is the seed), against the one boundary
log(margin), as a compare claim's interval is judged against zero:
- `budget-bound` when a paired seed is (as a compare claim with a run still improving);
- `inconclusive (needs 2 seeds)` with one paired seed: no seed variance, and 2 is the fewest that give
  an interval (whether 2 decide it is not known);
- `contradicted` when A never reached the target on any paired seed;
- every seed reached it: `held` when the interval's lower end >= log(margin) ("at least margin times
  fewer steps": inclusive, as an lr_sensitivity claim's margin), `contradicted` when its upper end
  < log(margin), else `inconclusive (needs N seeds)` (stats.seeds_needed, at the distance of the mean
  from log(margin)) or plain `inconclusive`;
- some seeds never reached it: never `held`; `contradicted` when the interval over the seeds that
  reached it lies below log(margin) (the others lie below the margin too), else `inconclusive`;
- `contradicted` is not given while a seed's speed-up is only a lower bound (`first`) below the margin.
A `margin` (> 1, required) is the smallest speed-up the study calls the claim's: set before the data.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from normlab.study.stats import seed_interval, seeds_needed

def curve(rec, metric: str) -> list[tuple[int, float]]:
    """(step, value) by step, one value per step (the last logged), finite values only."""
    points = {int(s): float(v) for s, v in rec.curve(metric) if math.isfinite(v)}
    return sorted(points.items())


def seed_speedup(a_rec, b_rec, metric: str, margin: float, plateau) -> dict:
    """One paired seed: {"seed", "state" (reached | first | never | budget-bound | no curve), "target",
    "steps_b", "steps_a", "speedup"; for never / budget-bound "a_steps" (L_A) and "bound" (steps_B / L_A)}."""
    from normlab.study.pace import reached_at  # (pace and variance import spec, which imports this module)

    ca, cb = curve(a_rec, metric), curve(b_rec, metric)
    out: dict = {"seed": a_rec.seed}
    if not ca or not cb:
        return {**out, "state": "no curve"}
    target = cb[-1][1]
    steps_b = reached_at(cb, target) + 1
    out.update(target=target, steps_b=steps_b, steps_a=None, speedup=None)
    at = reached_at(ca, target)
    if at is not None:
        first = ca[0][1] <= target
        return {**out, "state": "first" if first else "reached", "steps_a": at + 1, "speedup": steps_b / (at + 1)}
    last = ca[-1][0] + 1
    out.update(a_steps=last, bound=steps_b / last, state="never")
    if out["bound"] > margin and plateau is not None and \
            a_rec.still_improving(plateau.window, plateau.min_delta, plateau.cap):
        out["state"] = "budget-bound"
    return out


def seed_text(r: dict) -> str:
    """`s1 ×2.92`, `s1 ×≥1.20` (a lower bound), `s2 never (×<0.88)`, `s3 budget-bound (×<3.00)`."""
    if r.get("speedup") is not None:
        return f"s{r['seed']} ×{'≥' if r['state'] == 'first' else ''}{r['speedup']:.2f}"
    return f"s{r['seed']} {r['state']} (×<{r['bound']:.2f})"


def decide(study, v, A: list, B: list, max_seeds: int) -> list[str]:
    """The verdict of the paired runs A[i], B[i] (set on v: verdict, interval, needs, means, speedup);
    the notes it leaves."""
    from normlab.study.variance import paired_variance

    claim, a, b = v.claim, v.better, v.than
    m, metric = float(claim.margin), claim.metric
    rows = [seed_speedup(ra, rb, metric, m, study.plateau) for ra, rb in zip(A, B)]
    notes = []
    lost = [r["seed"] for r in rows if r["state"] == "no curve"]
    if lost:
        notes.append(f"no {metric} curve in metrics.csv: seed{'s' if len(lost) > 1 else ''} "
                     f"{', '.join(map(str, lost))} left out")
    rows = [r for r in rows if r["state"] != "no curve"]
    v.speedup = {"margin": m, "metric": metric, "seeds": {r["seed"]: r for r in rows}}
    if not rows:
        v.verdict = "no score"
        return notes
    v.means = {a: _last_mean(A, rows, metric), b: float(np.mean([r["target"] for r in rows]))}
    reached = [r for r in rows if r["speedup"] is not None]
    never = [r for r in rows if r["state"] == "never"]
    logs = [math.log(r["speedup"]) for r in reached]
    if logs:
        iv = seed_interval(float(np.mean(logs)), len(logs), [paired_variance(logs)])
        v.interval = replace(iv, method="log speed-up, " + iv.method)
    notes.append(f"speed-up steps_{b} / steps_{a} to {b}'s last {metric} (steps linear between validations; "
                 f"margin ×{m:g}): " + ", ".join(seed_text(r) for r in rows))
    low_first = any(r["state"] == "first" and r["speedup"] < m for r in rows)
    v.verdict, v.needs = verdict_of(rows, v.interval, m, low_first, lambda d: seeds_needed(
        d, len(logs), [paired_variance(logs)], 0.0, max_seeds))
    if len(rows) < 2:
        notes.append("one paired seed: no seed variance (2 are the fewest that give an interval)")
    if never:
        notes.append(f"{a} never reached the target on seed{'s' if len(never) > 1 else ''} "
                     f"{', '.join(str(r['seed']) for r in never)}: its speed-up there is below the margin")
    if low_first and v.verdict != "held":
        notes.append(f"{a} was at the target by its first validation: its speed-up there a lower bound")
    if study.plateau is not None:
        p = study.plateau
        still = [r.seed for r in B if r.still_improving(p.window, p.min_delta, p.cap) and r.seed in v.speedup["seeds"]]
        if still:
            notes.append(f"{b} still improving when it stopped on seed{'s' if len(still) > 1 else ''} "
                         f"{', '.join(map(str, still))}: the target is its {metric} there (at its budget)")
    return notes


def verdict_of(rows: list[dict], iv, margin: float, low_first: bool, needed) -> tuple[str, int | None]:
    """(verdict, seeds it needs) by the module's rule; iv: the interval of the log speed-ups of the seeds
    that reached the target (None when none did), needed(distance): stats.seeds_needed on their values."""
    bound, never = math.log(margin), any(r["state"] == "never" for r in rows)
    if any(r["state"] == "budget-bound" for r in rows):
        return "budget-bound", None
    if len(rows) < 2:
        return "inconclusive (needs 2 seeds)", 2
    if iv is None:  # no seed reached it
        return "contradicted", None
    if iv.low is not None and iv.low >= bound and not never:
        return "held", None
    if iv.high is not None and iv.high < bound and not low_first:
        return "contradicted", None
    needs = needed(abs(iv.diff - bound)) if iv.low is not None and not never and not low_first else None
    return (f"inconclusive (needs {needs} seeds)" if needs else "inconclusive"), needs


def _last_mean(recs: list, rows: list[dict], metric: str) -> float | None:
    seeds = {r["seed"] for r in rows}
    values = [curve(r, metric)[-1][1] for r in recs if r.seed in seeds]
    return float(np.mean(values)) if values else None
