"""Judge a study's claims from its records: a verdict and its uncertainty, never written by hand.
These are the rules; stats.py has the formulas, variance.py which seed variance each arm uses.

Comparisons (compare, similar, no_worse) are judged on the seed-level 95% interval of mean(A − B)
over the seeds both arms ran (stats.seed_interval): each arm's seed-to-seed variance, pooled over
its regime family where the study declares one (variance.py), plus the test sentences' variance
for a BLEU claim with `interval: bootstrap`; t with Welch–Satterthwaite df.
- compare (A better than B on a metric): `held` when the interval excludes zero in the paper's
  direction, `contradicted` when it excludes zero the other way.
- similar (A about as good as B): `held` when the interval lies inside ±margin, `contradicted`
  when it lies wholly outside.
- no_worse (A at most margin worse than B, the paper's "matches or improves"): `held` when the whole
  interval lies above −margin in the paper's direction, `contradicted` when it lies wholly below (a
  one-sided non-inferiority test: a large gain still holds).
- Otherwise `inconclusive (needs N seeds)` when N <= 10 paired seeds at the same variances would
  decide the observed difference (stats.seeds_needed); plain `inconclusive` when none would, when
  the difference sits on the boundary, or when a variance is not measured (one seed, no family).
  There is no other seed rule: the interval's width is the rule (issue 17's "3 seeds, or 2 with a
  difference > 3 sd" is replaced by it).
- `budget-bound`, whatever the interval says, when the study declares `plateau:` and a run of either
  arm on a paired seed completed while still improving: it never reached a validation plateau
  (Record.still_improving: results.json's `plateau`, else normlab.plateau's rule on its metrics.csv).
  Two points on learning curves are compared, not the schemes; the arms and seeds are shown.
- `no score` when both sides ran but one has no seed that trained to the end (diverged or stalled:
  shown with the statuses); `not run` when a side has no record yet or the sides share no scored seed.
Two metrics of the same runs (a pruned model against its own full model) use the variance of the
paired differences (df n − 1): the pairing is the run itself. The paired bootstrap over test
sentences with the runs fixed is shown beside the verdict as the test-set check (per-run,
sentences): it never decides.

Outcomes (how the runs ended):
- fails (A diverges or stalls, the paper's "failed to train"): `held` when every seed of A ended
  diverged or stalled, `contradicted` when every seed completed, `inconclusive` when mixed.
  In a screened study `held` also when A diverged or stalled at every setting of its learning-rate
  screen (then no setting is chosen and no seed runs: study/screen_outcome.py).
- trains: `contradicted` when every seed diverged or stalled, `inconclusive` when mixed. When every
  seed completed: `held` in a study without `reference:`; with one, `held` only when A ends within
  the study's trains_bar of the reference arm: its mean valid NLL at most valid_nll nats (default
  0.3) above the reference's, or its mean test BLEU at least test_bleu_ratio (default 0.5) of the
  reference's (the cell says which was met), else `learns, far behind`; `no score` when the
  reference has no completed seed to measure against, `not run` when it has no record. A run still
  improving at the cap is noted: the bar says where the arm ended at this budget. "A trains where F
  fails" (`where_fails: F`) in a screened study is judged on the screens too: a held verdict stays
  held only when A trained at every setting where F diverged or stalled (contradicted at none,
  inconclusive at some); when F trained at every setting the note says the part is untested.
LR sensitivity (lr_sensitivity: A less sensitive to the learning rate than B), from the two arms'
screens, one seed each: `held` when A's is lower by at least the claim's margin, `contradicted` when
higher by at least it, else `inconclusive` (study/lr_sensitivity.py has the definition and the rule).
Steps to a loss (fewer_steps: A reaches B's last validation loss at least `margin` times sooner), per
paired seed from the two runs' metrics.csv curves: `held` / `contradicted` when the t interval of the
log speed-ups lies at or above / below log(margin) (study/fewer_steps.py has the definition and rule).
A best_of side stands for the candidate arm with the best mean validation metric (never the test
metric the claim judges) among those with the fewest seeds that failed to train, chosen before the
comparison.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from normlab.outcome import FAILED_TO_TRAIN, Status
from normlab.study.damaged import read_text
from normlab.study.records import Record, is_test_bleu
from normlab.study.spec import Claim, Study, lower_is_better
from normlab.study.stats import Interval, corpus_bleu, paired_bootstrap, seed_interval, seeds_needed, sentence_stats
from normlab.study.variance import arm_variance, describe, paired_variance

SCORED = (Status.COMPLETED.value,)  # a claim compares scores of runs that trained to the end
MAX_SEEDS = 10  # "needs N seeds" up to this many; beyond it a claim is plainly inconclusive


@dataclass
class Verdict:
    claim: Claim
    verdict: str    # held | contradicted | inconclusive [(needs N seeds)] | budget-bound | learns, far behind
                    # | no score | not run
    better: str                       # the arms that stood for each side (a best_of group: the pick)
    than: str | None
    interval: Interval | None = None  # the seed-level interval: decides
    means: dict = field(default_factory=dict)     # arm -> mean metric over its scored seeds
    statuses: dict = field(default_factory=dict)  # arm -> {status: count}
    note: str = ""
    check: Interval | None = None     # the test-set check (per run, sentences): shown, never decides
    variance: dict = field(default_factory=dict)  # arm -> stats.Variance its side used
    improving: dict = field(default_factory=dict)  # arm -> seeds still improving at the end
    needs: int | None = None          # inconclusive: the paired seeds that would decide it
    bar: dict | None = None           # trains with a reference: the bar's two criteria
    sensitivity: dict | None = None   # lr_sensitivity: arm -> its screen's (study/lr_sensitivity.py)
    speedup: dict | None = None       # fewer_steps: {margin, metric, seeds: {seed: ...}} (study/fewer_steps.py)

    def as_dict(self) -> dict:
        iv, ck = self.interval, self.check
        return {"id": self.claim.id, "claim": self.claim.claim, "source": self.claim.source, "paper": self.claim.paper,
                "paper_effect": self.claim.paper_effect, "carried_from": self.claim.carried_from, "kind": self.claim.kind, "metric": self.claim.metric,
                "verdict": self.verdict, "better": self.better, "than": self.than, "means": self.means,
                "statuses": self.statuses, "note": self.note,
                "difference": None if iv is None else {"mean": iv.diff, "low": iv.low, "high": iv.high, "method": iv.method,
                                                       "paired_seeds": iv.n, "df": iv.df, "se": iv.se, "decides": True},
                "variance": {arm: asdict(v) for arm, v in self.variance.items()},
                "test_set_check": None if ck is None else {"mean": ck.diff, "low": ck.low, "high": ck.high,
                                                           "method": ck.method, "se": ck.se, "decides": False},
                "budget_bound": self.improving or None, "needs_seeds": self.needs, "trains_bar": self.bar,
                **({"lr_sensitivity": self.sensitivity, "margin": self.claim.margin} if self.sensitivity else {}),
                **({"fewer_steps": self.speedup, "margin": self.claim.margin} if self.speedup else {})}


def statuses(records: list[Record]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.status] = out.get(r.status, 0) + 1
    return out


def pick(study: Study, side: str, by_arm: dict[str, list[Record]]) -> tuple[str, str]:
    """(arm, note): the arm itself, or the best_of group's candidate with the best validation mean."""
    if side not in study.best_of:
        return side, ""
    group = study.best_of[side]
    by = group["by"]
    best, best_value = None, None
    for arm in group["arms"]:
        runs = by_arm.get(arm, [])
        values = [r.metric(by) for r in runs if r.status in SCORED and r.metric(by) is not None]
        if not values:
            continue
        # the lowest share of recorded seeds that failed to train first, then the mean: a stalled run
        # has no valid BLEU (final_test.py), and a mean over the seeds that trained must not put a
        # setting that stalls on one seed first. A share, not a count, so that a candidate with
        # fewer seeds recorded so far (an unfinished study) is not favoured.
        failed = sum(r.status in FAILED_TO_TRAIN for r in runs) / len(runs)
        v = (-failed, float(np.mean(values)) * (-1 if lower_is_better(by) else 1))
        if best_value is None or v > best_value:
            best, best_value = arm, v
    if best is None:  # the first candidate that ran: its stalled or diverged runs are shown
        ran = next((arm for arm in group["arms"] if by_arm.get(arm)), group["arms"][0])
        return ran, f"{side}: no candidate scored"
    return best, f"{side} = {best} (best of {', '.join(group['arms'])} by mean {by}, fewest seeds that failed to train first)"


def judge(study: Study, by_arm: dict[str, list[Record]], refs: list[str] | None,
          screens: dict[str, dict] | None = None) -> list[Verdict]:
    """screens: {arm: its screen's record} (screen_outcome.load_screens) for the outcome claims."""
    return [judge_one(study, c, by_arm, refs, screens or {}) for c in study.claims]


def judge_one(study: Study, claim: Claim, by_arm: dict[str, list[Record]], refs: list[str] | None,
              screens: dict[str, dict] | None = None) -> Verdict:
    a, note_a = pick(study, claim.better, by_arm)
    if claim.kind in ("fails", "trains"):
        v = outcome(study, claim, a, note_a, by_arm)
        return on_screens(v, claim, a, screens or {})
    b, note_b = pick(study, claim.than, by_arm)
    if claim.kind == "lr_sensitivity":
        return on_sensitivity(claim, a, b, by_arm, screens or {})
    ma, mb = claim.metric, claim.than_metric or claim.metric
    steps = claim.kind == "fewer_steps"  # its metric a curve (metrics.csv), not a results.json score
    A = {r.seed: r for r in by_arm.get(a, []) if r.status in SCORED and (steps or r.metric(ma) is not None)}
    B = {r.seed: r for r in by_arm.get(b, []) if r.status in SCORED and (steps or r.metric(mb) is not None)}
    v = Verdict(claim, "not run", a, b, statuses={a: statuses(by_arm.get(a, [])), b: statuses(by_arm.get(b, []))},
                means={a: _mean([r.metric(ma) for r in A.values()]), b: _mean([r.metric(mb) for r in B.values()])},
                note="; ".join(n for n in (note_a, note_b) if n))
    seeds = sorted(set(A) & set(B))
    if not seeds:
        ran = [by_arm.get(a), by_arm.get(b)]  # (a best_of side that never scored: pick's first that ran)
        if all(ran) and not all(any(r.status in SCORED for r in recs) for recs in ran):
            v.verdict = "no score"  # both ran, one never trained to the end: "not run" would hide that
        return v
    notes = [v.note]
    if set(A) != set(B):  # an arm with extra seeds: the claim pairs the seeds both ran
        v.means = {a: _mean([A[s].metric(ma) for s in seeds]), b: _mean([B[s].metric(mb) for s in seeds])}
        notes.append(f"paired on seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds))}")
    if steps:  # its own budget-bound rule: the seeds A stopped early while improving (study/fewer_steps.py)
        from normlab.study.fewer_steps import decide as decide_steps

        v.note = "; ".join(n for n in [*notes, *decide_steps(study, v, [A[s] for s in seeds],
                                                                [B[s] for s in seeds], MAX_SEEDS)] if n)
        return v
    notes += decide(study, v, [A[s] for s in seeds], [B[s] for s in seeds], by_arm, refs)
    if study.plateau is not None:
        v.improving, unknown = improving(study, {a: [A[s] for s in seeds], b: [B[s] for s in seeds]})
        if v.improving:
            v.verdict = "budget-bound"
        notes += [improving_text(study, v.improving)] if v.improving else []
        notes += [f"plateau not known (no valid/loss curve): {unknown}"] if unknown else []
    v.note = "; ".join(n for n in notes if n)
    return v


def decide(study: Study, v: Verdict, A: list[Record], B: list[Record], by_arm: dict[str, list[Record]],
           refs: list[str] | None) -> list[str]:
    """The seed-level interval of the paired runs A[i], B[i], its verdict and the seeds it needs
    (set on v); the notes it leaves."""
    claim, a, b = v.claim, v.better, v.than
    ma, mb = claim.metric, claim.than_metric or claim.metric
    notes = []
    if claim.interval == "bootstrap" and is_test_bleu(ma) and is_test_bleu(mb):
        v.check = _bootstrap(A, B, refs, ma, mb)
        if v.check is None:
            notes.append("no test hypotheses, or references that do not reproduce test_bleu: no test-set check, "
                         "and the seed interval without the test sentences' variance")
    diffs = [ra.metric(ma) - rb.metric(mb) for ra, rb in zip(A, B)]
    if a == b:  # two metrics of the same runs
        v.variance = {a: paired_variance(diffs)}
    else:
        v.variance = {a: arm_variance(study, by_arm, a, ma), b: arm_variance(study, by_arm, b, mb)}
    sentence_var = v.check.se ** 2 if v.check is not None and v.check.se is not None else 0.0
    variances = list(v.variance.values())
    v.interval = seed_interval(float(np.mean(diffs)), len(diffs), variances, sentence_var)
    lower = claim.direction == "lower" if claim.direction else lower_is_better(ma)
    v.verdict = verdict_of(v.interval, claim, lower)
    if v.verdict == "inconclusive" and v.interval.low is not None:
        v.needs = seeds_needed(boundary_distance(v.interval.diff, claim, lower), len(diffs), variances, sentence_var,
                               MAX_SEEDS)
        if v.needs:
            v.verdict = f"inconclusive (needs {v.needs} seeds)"
    return [*notes, "seed variance: " + describe(v.variance)]


def improving(study: Study, runs: dict[str, list[Record]]) -> tuple[dict[str, list[int]], str]:
    """({arm: seeds whose run completed still improving}, the runs whose plateau is not known)."""
    p = study.plateau
    out: dict[str, list[int]] = {}
    unknown = []
    for arm, recs in runs.items():
        for r in recs:
            state = r.still_improving(p.window, p.min_delta, p.cap)
            if state:
                out.setdefault(arm, []).append(r.seed)
            elif state is None:
                unknown.append(f"{arm} s{r.seed}")
    return {arm: sorted(set(s)) for arm, s in out.items()}, ", ".join(unknown)


def improving_text(study: Study, arms: dict[str, list[int]]) -> str:
    p = study.plateau
    who = "; ".join(f"{arm} s{', s'.join(map(str, seeds))}" for arm, seeds in arms.items())
    return (f"still improving when it stopped (no plateau: its valid loss never gained < {p.min_delta:g} over "
            f"{p.window} steps; cap {p.cap}): {who}")


def outcome(study: Study, claim: Claim, a: str, note: str, by_arm: dict[str, list[Record]]) -> Verdict:
    """fails / trains: how A's runs ended, and for trains with a reference, how far from it."""
    recs = by_arm.get(a, [])
    st = statuses(recs)
    failed = sum(st.get(s, 0) for s in FAILED_TO_TRAIN)
    done = st.get("completed", 0)
    v = Verdict(claim, "not run", a, None, statuses={a: st}, note=note)
    if failed + done == 0:
        return v
    says_fails = claim.kind == "fails"
    if failed and not done:
        v.verdict = "held" if says_fails else "contradicted"
    elif done and not failed:
        v.verdict = "contradicted" if says_fails else "held"
    else:
        v.verdict = "inconclusive"
    v.means = {a: _mean([r.metric(claim.metric) for r in recs if r.status in SCORED])}
    if says_fails or v.verdict != "held" or study.reference is None:
        return v
    v.verdict, v.bar = trains_bar(study, a, by_arm)
    if study.plateau is not None:
        arms, _ = improving(study, {a: recs})
        v.note = "; ".join(filter(None, [v.note, improving_text(study, arms) if arms else ""]))
    return v


def on_screens(v: Verdict, claim: Claim, a: str, screens: dict[str, dict]) -> Verdict:
    """The screen's part of an outcome claim (study/screen_outcome.py): a fails claim holds when the arm
    failed at every setting of its screen; "A trains where F fails" needs A to train where F failed."""
    from normlab.study.screen_outcome import fails_on_screen, where_fails

    everywhere, line = fails_on_screen(screens.get(a))
    if claim.kind == "fails":
        if everywhere:  # no seed ran (nothing chosen): held; seeds that trained beside it: say both
            v.verdict = "held" if v.verdict in ("not run", "held") else "inconclusive"
        v.note = "; ".join(filter(None, [v.note, line]))
        return v
    if everywhere and v.verdict == "not run":  # a trains claim of an arm that failed at every setting
        v.verdict = "contradicted"
        v.note = "; ".join(filter(None, [v.note, line]))
    if claim.where_fails:
        part, line = where_fails(a, screens.get(a), claim.where_fails, screens.get(claim.where_fails))
        if part is not None and v.verdict == "held":
            v.verdict = part
        v.note = "; ".join(filter(None, [v.note, line]))
    return v


def on_sensitivity(claim: Claim, a: str, b: str, by_arm: dict[str, list[Record]], screens: dict[str, dict]) -> Verdict:
    """lr_sensitivity: the two arms' screens (study/lr_sensitivity.py), one seed each: no interval."""
    from normlab.study import lr_sensitivity

    verdict, sens, note = lr_sensitivity.judge(claim, a, b, screens)
    return Verdict(claim, verdict, a, b, statuses={a: statuses(by_arm.get(a, [])), b: statuses(by_arm.get(b, []))},
                   means={arm: (s or {}).get("value") for arm, s in sens.items()}, note=note, sensitivity=sens)


def trains_bar(study: Study, a: str, by_arm: dict[str, list[Record]]) -> tuple[str, dict | None]:
    """(verdict, the bar's criteria): held when either criterion is met, else learns, far behind."""
    ref, bar = study.reference, study.trains_bar
    if not by_arm.get(ref):
        return "not run", {"reference": ref}

    def mean(arm: str, metric: str) -> float | None:
        return _mean([r.metric(metric) for r in by_arm.get(arm, []) if r.status in SCORED])

    out: dict = {"reference": ref}
    nll, nll_ref = mean(a, "valid_nll"), mean(ref, "valid_nll")
    if nll is not None and nll_ref is not None:
        out["valid_nll"] = {"arm": nll, "reference": nll_ref, "gap": nll - nll_ref, "bar": bar.valid_nll,
                            "met": nll - nll_ref <= bar.valid_nll}
    bleu, bleu_ref = mean(a, "test_bleu"), mean(ref, "test_bleu")
    if bleu is not None and bleu_ref:
        out["test_bleu"] = {"arm": bleu, "reference": bleu_ref, "ratio": bleu / bleu_ref, "bar": bar.test_bleu_ratio,
                            "met": bleu / bleu_ref >= bar.test_bleu_ratio}
    if len(out) == 1:
        return "no score", out
    return ("held" if any(c["met"] for k, c in out.items() if k != "reference") else "learns, far behind"), out


def boundary_distance(diff: float, claim: Claim, lower_better: bool) -> float:
    """How far the observed difference lies from the nearest boundary its verdict must clear: zero
    (compare), ±margin (similar), −margin in the paper's direction (no_worse)."""
    x = -diff if lower_better else diff
    bounds = {"similar": (-claim.margin, claim.margin), "no_worse": (-claim.margin,)}.get(claim.kind, (0.0,))
    return min(abs(x - b) for b in bounds)


def verdict_of(iv: Interval, claim: Claim, lower_better: bool) -> str:
    """compare: the interval excludes zero in the paper's direction (held) or the other (contradicted);
    similar: it lies inside ±margin (held) or wholly outside it (contradicted); no_worse: above
    −margin (held) or wholly at or below it (contradicted)."""
    if iv.low is None:
        return "inconclusive"
    if claim.kind == "similar":
        m = claim.margin
        if -m < iv.low and iv.high < m:
            return "held"
        return "contradicted" if iv.low >= m or iv.high <= -m else "inconclusive"
    sign = -1.0 if lower_better else 1.0  # the paper's direction: A better than B
    low, high = sorted((sign * iv.low, sign * iv.high))
    if claim.kind == "no_worse":
        return "held" if low > -claim.margin else "contradicted" if high <= -claim.margin else "inconclusive"
    if low > 0:
        return "held"
    return "contradicted" if high < 0 else "inconclusive"


def _mean(values: list) -> float | None:
    values = [x for x in values if x is not None]
    return float(np.mean(values)) if values else None


def _bootstrap(a: list[Record], b: list[Record], refs: list[str] | None, ma: str = "test_bleu",
               mb: str = "test_bleu") -> Interval | None:
    if refs is None:
        return None
    stats_a, stats_b = [], []
    for side, out, metric in ((a, stats_a, ma), (b, stats_b, mb)):
        for r in side:
            hyps = r.hypotheses(metric)
            if hyps is None or len(hyps) != len(refs):
                return None
            stats = sentence_stats(hyps, refs)
            # the references must be the ones the run was scored against: its own corpus BLEU again
            if abs(float(corpus_bleu(stats.sum(0))) - float(r.metric(metric) or -1)) > 0.01:
                return None
            out.append(stats)
    return paired_bootstrap(stats_a, stats_b)


def read_refs(path: Path | None) -> list[str] | None:
    """The test references (a damaged file is named once and left out: no test-set check)."""
    text = None if path is None else read_text(Path(path), "no test-set check over sentences (the references)")
    if text is None:
        return None
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")
