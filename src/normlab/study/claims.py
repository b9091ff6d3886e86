"""Judge a study's claims from its records: a verdict and its uncertainty, never written by hand.

- compare (A better than B on a metric): `held` when the 95% interval of mean(A - B) over paired
  seeds excludes zero in the paper's direction, `contradicted` when it excludes zero the other way,
  `inconclusive` otherwise; `no score` when both sides ran but one has no seed that trained to the
  end (diverged or stalled: shown with the statuses; a `trains` claim judges that), `not run` when a
  side has no record yet or the sides share no scored seed.
- similar (A about as good as B): `held` when the interval lies inside ±margin, `contradicted` when
  it lies wholly outside, `inconclusive` otherwise.
- no_worse (A at most margin worse than B, the paper's "matches or improves"): `held` when the whole
  interval lies above −margin in the paper's direction, `contradicted` when it lies wholly below,
  `inconclusive` otherwise (a one-sided non-inferiority test: a large gain still holds).
- fails (A diverges or stalls, the paper's "failed to train"): `held` when every seed of A ended
  diverged or stalled, `contradicted` when every seed completed, `inconclusive` when mixed.
- trains (A trains where the paper says it does): the reverse of fails.
Seeds (issue 17: at least 3, unless the effect is larger than 3 standard deviations with 2): a claim
judged on fewer than 3 paired seeds notes how many standard deviations of the seeds' paired
differences its mean difference lies from the claim's decision boundary (zero for compare, the
margin for similar and no_worse), and whether that is enough by this rule (`seeds_rule`).
A best_of side stands for the candidate arm with the best mean validation metric (never the test
metric the claim judges) among those with the fewest seeds that failed to train, chosen before the
comparison.
"""
from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from normlab.outcome import FAILED_TO_TRAIN, Status
from normlab.study.records import Record, is_test_bleu
from normlab.study.spec import Claim, Study, lower_is_better
from normlab.study.stats import Interval, corpus_bleu, paired_bootstrap, paired_t, sentence_stats

SCORED = (Status.COMPLETED.value,)  # a claim compares scores of runs that trained to the end


@dataclass
class Verdict:
    claim: Claim
    verdict: str                      # held | contradicted | inconclusive | no score | not run
    better: str                       # the arms that stood for each side (a best_of group: the pick)
    than: str | None
    interval: Interval | None = None
    means: dict = field(default_factory=dict)     # arm -> mean metric over its scored seeds
    statuses: dict = field(default_factory=dict)  # arm -> {status: count}
    note: str = ""
    seeds_rule: dict | None = None    # fewer than 3 paired seeds: {seeds, effect_sd, enough} (see above)

    def as_dict(self) -> dict:
        iv = self.interval
        return {"id": self.claim.id, "claim": self.claim.claim, "source": self.claim.source, "paper": self.claim.paper,
                "kind": self.claim.kind, "metric": self.claim.metric, "verdict": self.verdict, "better": self.better,
                "than": self.than, "means": self.means, "statuses": self.statuses, "note": self.note,
                "seeds_rule": self.seeds_rule,
                "difference": None if iv is None else {"mean": iv.diff, "low": iv.low, "high": iv.high,
                                                       "method": iv.method, "paired_seeds": iv.n}}


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


def judge(study: Study, by_arm: dict[str, list[Record]], refs: list[str] | None) -> list[Verdict]:
    return [judge_one(study, c, by_arm, refs) for c in study.claims]


def judge_one(study: Study, claim: Claim, by_arm: dict[str, list[Record]], refs: list[str] | None) -> Verdict:
    a, note_a = pick(study, claim.better, by_arm)
    if claim.kind in ("fails", "trains"):
        recs = by_arm.get(a, [])
        st = statuses(recs)
        failed = sum(st.get(s, 0) for s in FAILED_TO_TRAIN)
        done = st.get("completed", 0)
        v = Verdict(claim, "not run", a, None, statuses={a: st}, note=note_a)
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
        return v
    b, note_b = pick(study, claim.than, by_arm)
    ma, mb = claim.metric, claim.than_metric or claim.metric
    A = {r.seed: r for r in by_arm.get(a, []) if r.status in SCORED and r.metric(ma) is not None}
    B = {r.seed: r for r in by_arm.get(b, []) if r.status in SCORED and r.metric(mb) is not None}
    v = Verdict(claim, "not run", a, b, statuses={a: statuses(by_arm.get(a, [])), b: statuses(by_arm.get(b, []))},
                means={a: _mean([r.metric(ma) for r in A.values()]), b: _mean([r.metric(mb) for r in B.values()])},
                note="; ".join(n for n in (note_a, note_b) if n))
    seeds = sorted(set(A) & set(B))
    if not seeds:
        ran = [by_arm.get(a), by_arm.get(b)]  # (a best_of side that never scored: pick's first that ran)
        if all(ran) and not all(any(r.status in SCORED for r in recs) for recs in ran):
            v.verdict = "no score"  # both ran, one never trained to the end: "not run" would hide that
        return v
    iv = None
    if claim.interval == "bootstrap" and is_test_bleu(ma) and is_test_bleu(mb):
        iv = _bootstrap([A[s] for s in seeds], [B[s] for s in seeds], refs, ma, mb)
        if iv is None:
            v.note = "; ".join(filter(None, [v.note, "no test hypotheses, or references that do not reproduce "
                                                     "test_bleu, for the bootstrap: t interval"]))
    if iv is None:
        iv = paired_t([A[s].metric(ma) for s in seeds], [B[s].metric(mb) for s in seeds])
    v.interval = iv
    lower = claim.direction == "lower" if claim.direction else lower_is_better(ma)
    v.verdict = verdict_of(iv, claim, lower)
    if set(A) != set(B):  # an arm with extra seeds: the claim pairs the seeds both ran
        v.means = {a: _mean([A[s].metric(ma) for s in seeds]), b: _mean([B[s].metric(mb) for s in seeds])}
        paired = f"paired on seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds))}"
        v.note = "; ".join(filter(None, [v.note, paired]))
    if len(seeds) < 3:
        v.seeds_rule = seeds_rule([A[s].metric(ma) - B[s].metric(mb) for s in seeds], claim, lower)
        v.note = "; ".join(filter(None, [v.note, v.seeds_rule["text"]]))
    return v


def seeds_rule(diffs: list[float], claim: Claim, lower_better: bool = False) -> dict:
    """The issue's rule for fewer than 3 seeds: 2 paired seeds are enough when the mean difference
    is more than 3 standard deviations of the seeds' differences (the sd the t interval uses) from
    the claim's decision boundary: zero for compare, the margin for similar (|mean| against it) and
    no_worse (−margin in the paper's direction). With 1 seed the spread over seeds is not measured."""
    n, mean = len(diffs), float(np.mean(diffs))
    sign = -1.0 if lower_better else 1.0
    boundary = {"similar": abs(abs(mean) - claim.margin),
                "no_worse": abs(sign * mean + claim.margin)}.get(claim.kind, abs(mean))
    what = "the difference" if claim.kind == "compare" else f"the difference's distance from the margin {claim.margin:g}"
    # (a similar / no_worse claim's margin is a positive number: spec.load_study checks it)
    sd = float(np.std(diffs, ddof=1)) if n > 1 else None
    k = boundary / sd if sd else (float("inf") if sd == 0 and boundary else None)
    enough = n == 2 and k is not None and k > 3
    text = (f"{n} paired seed{'s' if n > 1 else ''}: " +
            (f"{what} is {k:.1f} sd of the seeds' differences" if k is not None and k != float("inf")
             else "the seeds' spread is not measured" if n < 2 else "the seeds' differences are equal")
            + ("; enough by the rule (> 3 sd with 2 seeds)" if enough else
               "; a third seed is needed (the rule: 3 seeds, or 2 with > 3 sd)" if n == 2 else
               "; two more seeds are needed (the rule: 3 seeds, or 2 with > 3 sd)"))
    return {"seeds": n, "effect_sd": None if k is None or k == float("inf") else round(k, 2), "enough": enough,
            "from_margin": claim.kind != "compare", "text": text}


def verdict_of(iv: Interval, claim: Claim, lower_better: bool) -> str:
    """compare: the interval excludes zero in the paper's direction (held) or the other (contradicted);
    similar: it lies inside ±margin (held) or wholly outside it (contradicted)."""
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
    if path is None or not Path(path).is_file():
        return None
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]
