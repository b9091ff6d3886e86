"""The seed variance each arm of a comparison is judged with (stats.Variance): the variance of its
regime family's seeds, pooled, or its own (issue 35, item 3).

An arm's family is its `family:` in the study file (default: the arm alone, no pooling). A
family's variance of a metric pools the completed seeds of its arms (stats.pooled_variance), so an
arm with 2 seeds borrows the df of its family, and an arm with 1 seed gets a variance at all. An arm
whose seeds diverge from the rest uses its own variance instead, and is left out of the pool:

- a seed that diverged or stalled beside seeds that completed: the arm is at the edge of stability
  in this regime, and its completed seeds' spread is not the family's;
- its variance exceeds the pooled variance of the family's other arms by a one-sided F test at 5%:
  s²_arm / s²_rest > F_{0.95}(n_arm − 1, df_rest). Not "sd > k x the family's median sd": with 2-3
  seeds a sample sd is so noisy that such a rule flags an arm of the common variance 11-20% of the
  time at k = 3 (simulated for 2 seeds and 2-6 arms; 3-10% with 3 seeds), a rate that moves with the
  seed count; the F test flags 5% whatever the counts, and tests the one assumption pooling makes (a
  common variance). A false flag errs on the wide side: the flagged arm's own variance is the larger
  one, with fewer df.
"""
from __future__ import annotations

import numpy as np

from normlab.outcome import FAILED_TO_TRAIN
from normlab.study.records import Record
from normlab.study.spec import Study
from normlab.study.stats import Variance, f_quantile, pooled_variance

LEVEL = 0.95  # the F test's one-sided level


def values(recs: list[Record], metric: str) -> list[float]:
    """The metric over an arm's seeds that trained to the end."""
    return [v for r in recs if r.status == "completed" and (v := r.metric(metric)) is not None]


def own(arm: str, vals: list[float], why: str = "") -> Variance:
    s2, df = pooled_variance([vals])
    return Variance(s2, df, f"arm:{arm}", (arm,) if df else (), why)


def diverging(study: Study, by_arm: dict[str, list[Record]], family: str, metric: str) -> dict[str, str]:
    """{arm: why} for the family's arms whose seeds diverge from the rest (the rules above)."""
    members = [a for a, spec in study.arms.items() if spec.family == family]
    vals = {a: values(by_arm.get(a, []), metric) for a in members}
    out = {}
    for a in members:
        failed = sum(r.status in FAILED_TO_TRAIN for r in by_arm.get(a, []))
        if failed and vals[a]:
            out[a] = f"{failed} seed{'s' if failed > 1 else ''} diverged or stalled beside {len(vals[a])} that completed"
    for a in members:
        if a in out or len(vals[a]) < 2:
            continue
        rest = [vals[b] for b in members if b != a and b not in out]
        s2_rest, df_rest = pooled_variance(rest)
        s2, df = pooled_variance([vals[a]])
        if not df_rest or s2 is None:
            continue
        bound = f_quantile(LEVEL, df, df_rest)
        if s2 > bound * s2_rest:  # (s2_rest == 0: any spread is larger)
            ratio = f"{s2 / s2_rest:.1f}x" if s2_rest > 0 else "above"
            out[a] = (f"its seed variance {s2:.3g} is {ratio} the rest of {family}'s {s2_rest:.3g}, above "
                      f"F_0.95({df}, {df_rest}) = {bound:.1f}")
    return out


def arm_variance(study: Study, by_arm: dict[str, list[Record]], arm: str, metric: str) -> Variance:
    """The variance an arm's side of a claim uses (a best_of side: its pick's)."""
    spec = study.arms.get(arm)
    mine = values(by_arm.get(arm, []), metric)
    if spec is None or spec.family is None:
        return own(arm, mine)
    flagged = diverging(study, by_arm, spec.family, metric)
    if arm in flagged:
        return own(arm, mine, flagged[arm])
    members = [a for a, s in study.arms.items() if s.family == spec.family and a not in flagged]
    groups = {a: values(by_arm.get(a, []), metric) for a in members}
    s2, df = pooled_variance(list(groups.values()))
    return Variance(s2, df, f"family:{spec.family}", tuple(a for a, g in groups.items() if len(g) > 1))


def paired_variance(diffs: list[float]) -> Variance:
    """Two metrics of the same runs (a pruned model against its own full model): the variance of
    the paired differences, df n − 1 (the pairing is the run itself)."""
    s2 = float(np.var(diffs, ddof=1)) if len(diffs) > 1 else None
    return Variance(s2, max(len(diffs) - 1, 0), "paired differences")


def describe(variances: dict[str, Variance]) -> str:
    """`admin its own (s² 6.53, df 2: why); dlcl_pre, pre_ln pooled over family pre_ln_like (pre_ln,
    dlcl_pre, rezero: s² 0.162, df 4)`: the arms of a claim grouped by the variance they share."""
    groups: dict[str, list[str]] = {}
    for arm, v in variances.items():
        groups.setdefault(v.source, []).append(arm)
    parts = []
    for source, arms in groups.items():
        v = variances[arms[0]]
        est = "not measured" if v.s2 is None else f"s² {v.s2:.3g}, df {v.df}"
        if source.startswith("family:"):
            parts.append(f"{', '.join(arms)} pooled over family {source[7:]} "
                         f"({', '.join(v.arms) or 'no arm with 2 seeds'}: {est})")
        elif source == "paired differences":
            parts.append(f"the paired differences ({est})")
        else:
            parts.append(f"{arms[0]} its own ({est}{': ' + v.why if v.why else ''})")
    return "; ".join(parts)
